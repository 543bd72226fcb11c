"""kvtier's multi-pool ("v2") interface, called directly with real ``PoolTransfer`` objects
on the real DeepSeek-V4 host pool group (logical anchor + paged side pools + state pools)
and on a real MHA pool.

Expected answers are hand-computed from SGLang's fold rules (``HiCacheFile.batch_exists_v2``
/ ``PoolHitPolicy`` docstring) and kvtier's verdict rule (``crates/kvtier-proto/src/query.rs``:
every pool reports its own boundary over the whole span, 0 included).
Mocks appear only where a test forges a misbehaving part, and each says so.
"""

from __future__ import annotations

import logging

import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)

import kvtier_dev.harness.flows as cf
import kvtier_dev.harness.pools as sp
from kvtier.sglang import KvtierStore

DYNAMIC = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore"}
ALL, TRAIL, GROUPS = (
    PoolHitPolicy.ALL_PAGES,
    PoolHitPolicy.TRAILING_PAGES,
    PoolHitPolicy.BLOCK_GROUPS,
)
SWA, C4, IDX, C128 = (
    PoolName.SWA,
    PoolName.DEEPSEEK_V4_C4,
    PoolName.DEEPSEEK_V4_C4_INDEXER,
    PoolName.DEEPSEEK_V4_C128,
)
C4_STATE = PoolName.DEEPSEEK_V4_C4_STATE
PH = cf.PLACEHOLDER_KEY


def keys_for(n, tag="p"):
    return [f"{tag}{i:04d}" for i in range(n)]


def make_store(target=None, *, is_mla=True, **extra):
    ec = {**DYNAMIC, "dram_capacity_bytes": "64MiB", "interface_v1": 1, **extra}
    store = KvtierStore(sp.make_storage_config(is_mla=is_mla, extra_config=ec), {})
    if target is not None:
        cf.attach_backend(store, target)
    return store


@pytest.fixture
def dsv4():
    return sp.build_dsv4_pool_group("page_first")


def pool_of(stack, name):
    return stack.group.entry_map[name].host_pool


def idx_for(stack, name, n):
    """Host indices for n pages of pool ``name`` (state pools share SWA's allocator)."""
    if name in (SWA, C4_STATE, PoolName.DEEPSEEK_V4_C4_INDEXER_STATE):
        return sp.alloc_indices(pool_of(stack, SWA), n)
    return sp.alloc_indices(stack.anchor, n)


def put_pages(store, stack, name, keys, seed, extra_info=None):
    """Fill len(keys) fresh pages of pool ``name`` and store them under ``keys``."""
    idx = idx_for(stack, name, len(keys))
    written = sp.fill_pages(pool_of(stack, name), idx, seed)
    res = store.batch_set_v2(
        [PoolTransfer(name=name, host_indices=idx, keys=list(keys))], extra_info
    )
    assert res == {name: [True] * len(keys)}
    return idx, written


def present_at(store, stack, name, keys, pages, seed=1):
    """Store pool ``name`` only at the given page ordinals of ``keys``; {key: bytes}."""
    chosen = [keys[i] for i in pages]
    if not chosen:
        return {}
    idx, written = put_pages(store, stack, name, chosen, seed)
    owner = (
        pool_of(stack, SWA)
        if name in (SWA, C4_STATE, PoolName.DEEPSEEK_V4_C4_INDEXER_STATE)
        else stack.anchor
    )
    sp.free_indices(owner, idx)  # the bytes are in the store now
    return dict(zip(chosen, written))


def q(name, policy, window=None, **kw):
    keys = [PH] * window if window else None
    return PoolTransfer(name=name, keys=keys, hit_policy=policy, **kw)


def exists(store, keys, transfers):
    r = store.batch_exists_v2(keys, transfers)
    return r.kv_hit_pages, dict(r.extra_pool_hit_pages), r.restorable_prefix_pages


# ---------------------------------------------------------------------------
# TRAILING_PAGES
# ---------------------------------------------------------------------------


def test_trailing_state_with_a_hole_at_prefix_3(dsv4):
    store = make_store(dsv4)
    keys = keys_for(5)
    present_at(store, dsv4, C4, keys, range(5))
    swa = present_at(store, dsv4, SWA, keys, [1, 3], seed=2)  # prefixes 2 and 4, not 3

    hit, hits, restorable = exists(store, keys, [q(SWA, TRAIL, 1), q(C4, ALL)])
    assert (hit, restorable) == (4, [2, 4])
    # C4 comes after SWA and still reports its own run of 5, not the folded 4.
    assert hits == {PoolName.KV: 5, SWA: 4, C4: 5}
    # In the other order C4 reports its own run of 5, then SWA gates.
    hit, hits, restorable = exists(store, keys, [q(C4, ALL), q(SWA, TRAIL, 1)])
    assert (hit, restorable) == (4, [2, 4]) and hits == {PoolName.KV: 5, C4: 5, SWA: 4}
    # A 3-page span can only be restored to 2.
    assert exists(store, keys[:3], [q(SWA, TRAIL, 1), q(C4, ALL)])[::2] == (2, [2])

    # Per-page get of the window page: present at keys[1], absent at keys[2].
    idx = idx_for(dsv4, SWA, 1)
    sp.zero_pages(pool_of(dsv4, SWA), idx)
    assert store.batch_get_v2([PoolTransfer(name=SWA, host_indices=idx, keys=[keys[1]])]) == {
        SWA: [True]
    }
    assert sp.read_pages(pool_of(dsv4, SWA), idx) == [swa[keys[1]]]
    assert store.batch_get_v2([PoolTransfer(name=SWA, host_indices=idx, keys=[keys[2]])]) == {
        SWA: [False]
    }


@pytest.mark.parametrize(
    "window,expect",
    [(1, [1, 2, 4, 5, 6]), (2, [1, 2, 5, 6]), (3, [1, 2, 6])],
)
def test_trailing_windows_larger_than_one(dsv4, window, expect):
    store = make_store(dsv4)
    keys = keys_for(7)
    present_at(store, dsv4, SWA, keys, [0, 1, 3, 4, 5])  # page 2 and 6 missing
    hit, hits, restorable = exists(store, keys, [q(SWA, TRAIL, window)])
    # prefix p is restorable iff pages [max(0, p - window), p) all exist
    assert restorable == expect
    assert hit == max(expect) and hits[SWA] == max(expect) and hits[PoolName.KV] == 7


def test_two_trailing_pools_intersect(dsv4):
    store = make_store(dsv4)
    keys = keys_for(7)
    present_at(store, dsv4, SWA, keys, [0, 1, 3, 4, 5])  # window 2 -> {1, 2, 5, 6}
    present_at(store, dsv4, C4_STATE, keys, [1, 5, 6])  # window 1 -> {2, 6, 7}
    hit, hits, restorable = exists(store, keys, [q(SWA, TRAIL, 2), q(C4_STATE, TRAIL, 1)])
    assert (hit, restorable) == (6, [2, 6])
    # C4_STATE alone restores 7 (page 6 is there); SWA's cut does not shorten its verdict.
    assert hits == {PoolName.KV: 7, SWA: 6, C4_STATE: 7}


# ---------------------------------------------------------------------------
# ALL_PAGES: folded in order, each pool its own verdict
# ---------------------------------------------------------------------------


class RecordingNative:
    """Forwards to the real native store and records exists_v2 arguments (a recorder, not a
    mock: every call reaches the real store)."""

    def __init__(self, real):
        self._real = real
        self.exists_calls = []

    def exists_v2(self, *args):
        self.exists_calls.append(args)
        return self._real.exists_v2(*args)

    def __getattr__(self, name):
        return getattr(self._real, name)


def test_all_pages_pools_fold_in_order_and_report_their_own_runs(dsv4):
    store = make_store(dsv4)
    keys = keys_for(8)
    present_at(store, dsv4, C4, keys, [0, 1, 2, 3, 4, 6, 7])  # run 5
    present_at(store, dsv4, IDX, keys, range(8))  # run 8
    present_at(store, dsv4, C128, keys, [0, 1, 2, 4, 5, 6, 7])  # run 3
    rec = RecordingNative(store._store)
    store._store = rec

    # Hand fold: 8 -> C4 run 5 -> IDX run 8 -> C128 run 3; each verdict is the pool's own run.
    hit, hits, restorable = exists(store, keys, [q(C4, ALL), q(IDX, ALL), q(C128, ALL)])
    assert (hit, restorable) == (3, [1, 2, 3])
    assert hits == {PoolName.KV: 8, C4: 5, IDX: 8, C128: 3}

    hit, hits, restorable = exists(store, keys, [q(C128, ALL), q(C4, ALL), q(IDX, ALL)])
    assert (hit, restorable) == (3, [1, 2, 3])
    assert hits == {PoolName.KV: 8, C128: 3, C4: 5, IDX: 8}

    # One native call per query, carrying every pool in SGLang's order with its policy.
    assert len(rec.exists_calls) == 2
    prefix, sent_keys, kv_suffixes, pools = rec.exists_calls[1]
    assert sent_keys == keys and kv_suffixes is None  # logical anchor
    assert [(p[0], p[2]) for p in pools] == [
        ("deepseek_v4_c128", "all_pages"),
        ("deepseek_v4_c4", "all_pages"),
        ("deepseek_v4_c4_indexer", "all_pages"),
    ]
    assert [p[1] for p in pools] == [store._plans[str(n)].suffixes for n in (C128, C4, IDX)]

    # Once the fold reaches 0 the remaining pools are still evaluated: 0 is a verdict.
    hit, hits, restorable = exists(store, ["absent"] + keys[1:], [q(C4, ALL), q(IDX, ALL)])
    assert (hit, hits, restorable) == (0, {PoolName.KV: 8, C4: 0, IDX: 0}, [])


# ---------------------------------------------------------------------------
# BLOCK_GROUPS
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("group,verdict", [(1, 7), (2, 6), (3, 6), (4, 4), (7, 7), (8, 0), (10, 0)])
def test_block_groups_verdict_never_gates(dsv4, group, verdict):
    store = make_store(dsv4)
    keys = keys_for(10)
    present_at(store, dsv4, C4, keys, range(10))
    present_at(store, dsv4, C128, keys, range(7))
    hit, hits, restorable = exists(
        store, keys, [q(C4, ALL), q(C128, GROUPS, group_pages=group, block_pages=128)]
    )
    assert hit == 10 and restorable == list(range(1, 11))
    assert hits[C128] == verdict


def test_block_groups_report_their_own_groups_past_a_gate(dsv4):
    store = make_store(dsv4)
    keys = keys_for(10)
    present_at(store, dsv4, C4, keys, range(5))  # gates the span to 5
    present_at(store, dsv4, C128, keys, range(10))
    hit, hits, _ = exists(store, keys, [q(C4, ALL), q(C128, GROUPS, group_pages=2)])
    assert hit == 5 and hits[C128] == 10  # every group is there, whatever C4 cut
    hit, hits, _ = exists(store, keys, [q(C128, GROUPS, group_pages=4), q(C4, ALL)])
    assert hit == 5 and hits[C128] == 8  # two whole groups of 4; never gates


@pytest.mark.parametrize("kw", [{}, {"group_pages": 0}], ids=["missing", "zero"])
def test_block_groups_without_group_pages_gives_no_verdict(dsv4, caplog, kw):
    store = make_store(dsv4)
    keys = keys_for(4)
    present_at(store, dsv4, C128, keys, range(4))
    with caplog.at_level(logging.ERROR, logger="kvtier.sglang"):
        hit, hits, restorable = exists(store, keys, [q(C128, GROUPS, **kw)])
    assert (hit, restorable) == (4, [1, 2, 3, 4])
    assert C128 not in hits
    assert "group_pages" in caplog.text


# ---------------------------------------------------------------------------
# Logical anchor
# ---------------------------------------------------------------------------


def test_logical_anchor_hits_every_page_and_moves_nothing(dsv4):
    store = make_store(dsv4)
    keys = keys_for(6)
    hit, hits, restorable = exists(store, keys, [])
    assert (hit, hits, restorable) == (6, {PoolName.KV: 6}, [1, 2, 3, 4, 5, 6])
    assert exists(store, [], []) == (0, {}, [])
    assert store.batch_exists(keys) == 6

    idx = sp.alloc_indices(dsv4.anchor, 6)
    before = dict(store.get_stats().store)
    assert store.batch_set_v1(keys, idx) == [True] * 6
    assert store.batch_get_v1(keys, idx) == [True] * 6
    empty = [torch.empty(0, dtype=torch.uint8) for _ in keys]
    assert store.batch_set(keys, empty) is True
    got = store.batch_get(keys, empty)
    assert len(got) == 6 and all(g is e for g, e in zip(got, empty))
    after = dict(store.get_stats().store)
    for k in ("objects", "puts", "bytes_in", "bytes_out", "hits", "misses", "bytes_used"):
        assert after[k] == before[k] == 0, k


# ---------------------------------------------------------------------------
# Registration
# ---------------------------------------------------------------------------


def _covered(regions, tensor):
    start = tensor.untyped_storage().data_ptr()
    end = start + tensor.untyped_storage().nbytes()
    return any(s <= start and end <= s + n for _, s, n, _ in regions)


def test_kv_v2_registration_reuses_the_anchor():
    host = sp.build_mha_host_pool(size_pages=8)
    store = make_store(is_mla=False)
    store.register_mem_pool_host(host)
    regions = list(store._store.regions())
    assert len(regions) == 1 and _covered(regions, host.kv_buffer)
    store.register_mem_host_pool_v2(host, PoolName.KV)
    store.on_host_pools_registered()
    # The anchor is not registered (nor planned) twice; v2 KV transfers use its plan.
    assert list(store._store.regions()) == regions
    assert "kv" not in store._plans and store.registered_pools[PoolName.KV] is host
    idx = sp.alloc_indices(host, 2)
    want = sp.fill_pages(host, idx, 3)
    assert store.batch_set_v1(keys_for(2), idx) == [True, True]
    sp.zero_pages(host, idx)
    got = store.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=idx, keys=keys_for(2))])
    assert got == {PoolName.KV: [True, True]}
    assert sp.read_pages(host, idx) == want


def test_kv_registered_only_through_v2_becomes_the_anchor():
    host = sp.build_mha_host_pool(size_pages=8)
    store = make_store(is_mla=False)
    store.register_mem_host_pool_v2(host, PoolName.KV)
    store.on_host_pools_registered()
    assert store._anchor is not None and store._anchor.zero_copy
    idx = sp.alloc_indices(host, 2)
    want = sp.fill_pages(host, idx, 4)
    kv = PoolTransfer(name=PoolName.KV, host_indices=idx, keys=keys_for(2, "only-v2"))
    assert store.batch_set_v2([kv]) == {PoolName.KV: [True, True]}
    sp.zero_pages(host, idx)
    assert store.batch_get_v2([kv]) == {PoolName.KV: [True, True]}
    assert sp.read_pages(host, idx) == want


def test_every_physical_buffer_of_every_side_pool_is_registered(dsv4):
    store = make_store(dsv4)
    regions = list(store._store.regions())
    for spec in dsv4.side_specs:
        buffers = spec.host_pool.get_hybrid_pool_buffer()
        assert buffers, spec.name
        for t in buffers:
            assert _covered(regions, t), spec.name
        plan = store._plans[str(spec.name)]
        assert plan.zero_copy, spec.name
        assert {r[3] for r in regions if r[0] in plan.region_ids} == {str(spec.name)}
    assert store.get_stats()["registered_regions"] == len(regions) == len(dsv4.side_specs)


def _forge_no_meta(pool, monkeypatch):
    # Forged: a real pool whose get_page_buffer_meta is unavailable.
    def no_meta(indices):
        raise NotImplementedError("no page metadata")

    monkeypatch.setattr(pool, "get_page_buffer_meta", no_meta)


def _forge_foreign_pointers(pool, monkeypatch):
    # Forged: get_hybrid_pool_buffer() returns [] and the page pointers point into a copy of
    # the pool's buffer, so no pointer lies inside memory the pool exposes.
    shadow = pool.kv_buffer.clone()
    real = pool.get_page_buffer_meta
    delta = shadow.data_ptr() - pool.kv_buffer.data_ptr()
    monkeypatch.setattr(pool, "get_hybrid_pool_buffer", lambda: [])
    monkeypatch.setattr(
        pool, "get_page_buffer_meta", lambda idx: ([p + delta for p in real(idx)[0]], real(idx)[1])
    )
    pool._kvtier_shadow = shadow


@pytest.mark.parametrize(
    "forge", [_forge_no_meta, _forge_foreign_pointers], ids=["no-meta", "foreign-pointers"]
)
def test_pool_without_zero_copy_warns_once_and_round_trips_byte_exact(
    dsv4, caplog, monkeypatch, forge
):
    c4 = pool_of(dsv4, C4)
    forge(c4, monkeypatch)
    with caplog.at_level(logging.WARNING, logger="kvtier.sglang"):
        store = make_store(dsv4)
        assert not store._plans[str(C4)].zero_copy
        assert store._plans[str(C128)].zero_copy  # the other pools are unaffected
        keys = keys_for(3)
        idx, written = put_pages(store, dsv4, C4, keys, 7)
        _, written128 = put_pages(store, dsv4, C128, keys, 8)
        hit, hits, _ = exists(store, keys, [q(C4, ALL), q(C128, ALL)])
        assert hit == 3 and hits[C4] == 3
        sp.zero_pages(c4, idx)
        idx128 = idx_for(dsv4, C128, 3)
        got = store.batch_get_v2(
            [
                PoolTransfer(name=C4, host_indices=idx, keys=keys),
                PoolTransfer(name=C128, host_indices=idx128, keys=keys),
            ]
        )
        assert got == {C4: [True] * 3, C128: [True] * 3}
        assert sp.read_pages(c4, idx) == written
        assert sp.read_pages(pool_of(dsv4, C128), idx128) == written128
        put_pages(store, dsv4, C4, keys_for(2, "again"), 9)
    warnings = [
        r for r in caplog.records if r.levelno == logging.WARNING and "zero-copy" in r.getMessage()
    ]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]
    assert (
        "deepseek_v4_c4" in warnings[0].getMessage()
        and "DeepSeekV4PagedHostPool" in warnings[0].getMessage()
    )


# ---------------------------------------------------------------------------
# Per-page results
# ---------------------------------------------------------------------------


def test_get_reports_each_page_and_leaves_missing_pages_untouched(dsv4):
    store = make_store(dsv4)
    keys = keys_for(4)
    stored = present_at(store, dsv4, C4, keys, [0, 2], seed=3)
    pool = pool_of(dsv4, C4)
    idx = idx_for(dsv4, C4, 4)
    sentinel = sp.fill_pages(pool, idx, 99)
    got = store.batch_get_v2([PoolTransfer(name=C4, host_indices=idx, keys=keys)])
    assert got == {C4: [True, False, True, False]}
    assert sp.read_pages(pool, idx) == [stored[keys[0]], sentinel[1], stored[keys[2]], sentinel[3]]


def test_wrong_host_indices_length_fails_only_that_pool(dsv4, caplog):
    store = make_store(dsv4)
    keys = keys_for(3)
    c4_idx, c4_written = put_pages(store, dsv4, C4, keys, 4)
    c128_idx, c128_written = put_pages(store, dsv4, C128, keys, 5)
    sp.zero_pages(pool_of(dsv4, C4), c4_idx)
    sp.zero_pages(pool_of(dsv4, C128), c128_idx)
    short = c4_idx[: 2 * dsv4.page_size]
    with caplog.at_level(logging.ERROR, logger="kvtier.sglang"):
        got = store.batch_get_v2(
            [
                PoolTransfer(name=C4, host_indices=short, keys=keys),
                PoolTransfer(name=C128, host_indices=c128_idx, keys=keys),
            ]
        )
    assert got == {C4: [False] * 3, C128: [True] * 3}
    assert "host indices" in caplog.text
    assert sp.read_pages(pool_of(dsv4, C4), c4_idx) == [bytes(len(c4_written[0]))] * 3
    assert sp.read_pages(pool_of(dsv4, C128), c128_idx) == c128_written

    # Same on set: the mis-sized pool stores nothing, the other pool stores everything.
    fresh = keys_for(2, "fresh")
    idx4, idx128 = idx_for(dsv4, C4, 2), idx_for(dsv4, C128, 2)
    put = store.batch_set_v2(
        [
            PoolTransfer(name=C4, host_indices=idx4[:-1], keys=fresh),
            PoolTransfer(name=C128, host_indices=idx128, keys=fresh),
        ]
    )
    assert put == {C4: [False, False], C128: [True, True]}
    _, hits, _ = exists(store, fresh, [q(C128, ALL)])
    assert hits[C128] == 2
    assert exists(store, fresh, [q(C4, ALL)])[0] == 0
    # None host indices: also a clean failure for that pool only
    assert store.batch_get_v2([PoolTransfer(name=C4, host_indices=None, keys=keys)]) == {
        C4: [False] * 3
    }


def test_empty_v2_batches():
    host = sp.build_mha_host_pool(size_pages=4)
    store = make_store(host, is_mla=False)
    assert store.batch_get_v2([]) == {}
    assert store.batch_set_v2([]) == {}
    assert store.batch_get_v2(
        [PoolTransfer(name=SWA, host_indices=torch.empty(0, dtype=torch.int64), keys=[])]
    ) == {SWA: []}


# ---------------------------------------------------------------------------
# A side pool on MHA (same-shaped MHA host pool registered as a second pool)
# ---------------------------------------------------------------------------


def test_mha_anchor_with_a_side_pool():
    anchor = sp.build_mha_host_pool(size_pages=8)
    side = sp.build_mha_host_pool(size_pages=8)
    store = make_store(is_mla=False)
    store.register_mem_pool_host(anchor)
    store.register_mem_host_pool_v2(anchor, PoolName.KV)
    store.register_mem_host_pool_v2(side, PoolName.SWA)
    store.on_host_pools_registered()
    keys = keys_for(4)
    a_idx = sp.alloc_indices(anchor, 4)
    s_idx = sp.alloc_indices(side, 4)
    a_want = sp.fill_pages(anchor, a_idx, 1)
    s_want = sp.fill_pages(side, s_idx, 2)
    assert store.batch_set_v1(keys[:3], a_idx[: 3 * 16]) == [True] * 3  # KV for 3 pages
    assert store.batch_set_v2([PoolTransfer(name=SWA, host_indices=s_idx, keys=keys)]) == {
        SWA: [True] * 4
    }
    # real KV anchor: the KV run (3) bounds everything
    hit, hits, restorable = exists(store, keys, [q(SWA, TRAIL, 2)])
    # SWA holds all 4 pages: its own verdict is 4, whatever the KV run cuts.
    assert (hit, restorable) == (3, [1, 2, 3]) and hits == {PoolName.KV: 3, SWA: 4}
    assert store._plans["swa"].suffixes != store._anchor.suffixes
    sp.zero_pages(anchor, a_idx)
    sp.zero_pages(side, s_idx)
    assert store.batch_get_v1(keys[:3], a_idx[: 3 * 16]) == [True] * 3
    assert store.batch_get_v2([PoolTransfer(name=SWA, host_indices=s_idx, keys=keys)]) == {
        SWA: [True] * 4
    }
    assert sp.read_pages(anchor, a_idx)[:3] == a_want[:3]
    assert sp.read_pages(side, s_idx) == s_want


# ---------------------------------------------------------------------------
# Depth from extra_info.prefix_keys reaches v2 puts
# ---------------------------------------------------------------------------


def _write_chain(store, stack, chain, with_prefix):
    pool = pool_of(stack, C4)
    idx = idx_for(stack, C4, 8)
    done = []
    for i in range(0, len(chain), 8):
        batch = chain[i : i + 8]
        sp.fill_pages(pool, idx, seed=i)
        info = HiCacheStorageExtraInfo(prefix_keys=list(done)) if with_prefix else None
        assert store.batch_set_v2([PoolTransfer(name=C4, host_indices=idx, keys=batch)], info) == {
            C4: [True] * 8
        }
        done += batch


@pytest.mark.parametrize(
    "policy,with_prefix,head_survives",
    [("prefix_depth", True, True), ("prefix_depth", False, False), ("lru", True, False)],
    ids=["prefix_depth", "prefix_depth-no-prefix-keys", "lru"],
)
def test_prefix_keys_depth_reaches_v2_puts(dsv4, policy, with_prefix, head_survives):
    # C4 pages are 74880 bytes: a 1 MiB arena holds about 13 of the 48 written.
    extra = {"dram_capacity_bytes": "1MiB"}
    if policy == "lru":
        extra["eviction_policy"] = "lru"
    store = make_store(dsv4, **extra)
    assert f'eviction_policy = "{policy}"' in store._store.config_toml()
    chain = keys_for(48, "chain")
    _write_chain(store, dsv4, chain, with_prefix=with_prefix)
    assert store.get_stats()["evictions_capacity"] > 0
    hit, hits, _ = exists(store, chain, [q(C4, ALL)])
    if head_survives:
        assert hit >= 8, hits  # depth from prefix_keys kept the head of the chain
    else:
        # without depths (or under LRU) the oldest pages, the head, go first
        assert hit == 0, hits
