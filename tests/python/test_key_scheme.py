"""The key scheme has one definition (``kvtier_proto::keys``, issue 16): keys composed for every
pool kind and rank layout through the SGLang adapter's helpers parse back identically through
every consumer: the Rust parser, the metrics' pool label, the engine's eviction groups (events
of a real embedded store), and the KV-event page hash.
"""

from __future__ import annotations

import itertools
import json
import types

import numpy as np
import pytest

from kvtier import _native
from kvtier.kv_events import event_hash, page_hash_of_group
from kvtier.sglang import KEY_FORMAT_VERSION
from kvtier.sglang_keys import KeyLayout

FP = "0123456789ab"
PAGE = "a1b2c3d4e5f60718293a4b5c6d7e8f90"

# (pool base name, component count, mamba shape, expected pool label)
POOLS = [
    (None, 1, None, "kv"),  # MLA anchor: one component
    (None, 2, None, "kv"),  # MHA anchor: k, v
    (None, 4, None, "kv"),  # split components c0..c3
    ("swa", 2, None, "swa"),
    ("indexer", 1, None, "indexer"),
    ("deepseek_v4_c4", 1, None, "deepseek_v4_c4"),
    ("mamba", 3, (2, True), "mamba"),  # temporal, conv0, conv1
    ("mamba", 2, (2, False), "mamba"),
]

# (replicated, tp_rank, pp_size, pp_rank, cp_size, cp_rank, dcp_size, dcp_rank)
LAYOUTS = [
    (False, 0, 1, 0, 1, 0, 1, 0),
    (True, 0, 1, 0, 1, 0, 1, 0),
    (False, 3, 2, 1, 1, 0, 1, 0),
    (False, 1, 1, 0, 2, 1, 4, 3),
    (True, 7, 4, 2, 2, 0, 2, 1),
]


def adapter(layout):
    """The key layout the HiCache adapter and the linker compose with (``KvtierStore.key_layout``;
    a real adapter needs SGLang pools, the layout only these facts)."""
    replicated, tp, pp, ppr, cp, cpr, dcp, dcpr = layout
    fake = KeyLayout(
        tp_rank=tp,
        pp_size=pp,
        pp_rank=ppr,
        cp_size=cp,
        cp_rank=cpr,
        dcp_size=dcp,
        dcp_rank=dcpr,
    )
    return fake, replicated


def mamba_pool(shape):
    if shape is None:
        return None
    conv, temporal = shape
    return types.SimpleNamespace(
        conv_buffer=[object()] * conv, temporal_state_elem_size=8 if temporal else 0
    )


def composed():
    """Every (key, expectation) of every pool kind x rank layout x tag."""
    out = []
    for (base, count, shape, pool), layout, tag in itertools.product(POOLS, LAYOUTS, ["", "team/"]):
        fake, replicated = adapter(layout)
        rank_tag = fake.rank_tag(replicated)
        names = KeyLayout.component_names(base, count, mamba_pool(shape))
        assert len(names) == count
        for name in names:
            suffix = _native.key_suffix(FP, rank_tag, name)
            key = _native.key_compose(tag, PAGE, suffix)
            out.append((key, tag, rank_tag, name, pool, layout))
    return out


def test_rank_tags_and_names_match_the_documented_scheme():
    assert KEY_FORMAT_VERSION == 1
    fake, _ = adapter((False, 3, 2, 1, 1, 0, 4, 2))
    assert fake.rank_tag(False) == ".tp3.pp1.dcp2"
    assert fake.rank_tag(True) == ".pp1.dcp2"
    assert fake.rank_tag(False, 5) == ".tp5.pp1.dcp2"
    assert KeyLayout.component_names(None, 2) == ["k", "v"]
    assert KeyLayout.component_names(None, 1) == ["kv"]
    assert KeyLayout.component_names("swa", 3) == ["swa.c0", "swa.c1", "swa.c2"]
    assert KeyLayout.component_names("mamba", 3, mamba_pool((2, True))) == [
        "mamba.temporal",
        "mamba.conv0",
        "mamba.conv1",
    ]
    # A Mamba shape that does not match the count falls back to the generic names.
    assert KeyLayout.component_names("mamba", 2, mamba_pool((2, True))) == [
        "mamba.k",
        "mamba.v",
    ]


def test_every_key_parses_back_through_every_consumer():
    keys = composed()
    assert len(keys) > 100
    for key, tag, rank_tag, name, pool, layout in keys:
        # The Rust parser: every field back.
        parsed = _native.key_parse(key)
        assert parsed is not None, key
        p_tag, p_hash, p_fp, p_ranks, p_component = parsed
        assert p_tag == (tag[:-1] if tag else None)
        assert p_hash == PAGE and p_fp == FP and p_component == name
        assert "".join(f".{r}" for r in p_ranks) == rank_tag
        replicated = layout[0]
        assert any(r.startswith("tp") for r in p_ranks) == (not replicated)
        # Metrics: the pool label, from the key and from its suffix alone.
        assert _native.key_pool_of(key) == pool, key
        assert _native.key_pool_of(key[len(tag) + len(PAGE) :]) == pool
        # Eviction groups and KV events: the page group and its hash.
        group = _native.key_group_of(key)
        assert group == f"{tag}{PAGE}@"
        assert page_hash_of_group(group) == PAGE
        assert _native.key_page_hash(key) == PAGE
        assert event_hash(page_hash_of_group(group)) is not None


def test_the_engine_groups_pages_as_the_scheme_says():
    """A real embedded store: every component of one page, in every pool and rank layout,
    lands in one eviction group, reported by the engine's own events as ``[tag/]hash@``."""
    store = _native.Store(json.dumps({"dram_capacity_bytes": 64 << 20, "dram_prefault": False}))
    try:
        assert store.enable_events(1 << 16)
        keys = [k for k, *_ in composed()]
        buf = np.full(256, 3, dtype=np.uint8)
        ok, err = store.put_buffers(keys, [buf] * len(keys), None)
        assert all(ok), err
        events, dropped, _ = store.drain_events(1 << 16)
        assert dropped == 0
        stored = {group for _, kind, group, _ in events if kind == "stored"}
        assert stored == {f"{PAGE}@", f"team/{PAGE}@"}
        assert {page_hash_of_group(g) for g in stored} == {PAGE}
        # Every composed key is found under its own spelling.
        assert all(store.exists_keys(keys))
    finally:
        store.close()


@pytest.mark.parametrize(
    "prefix, new, window, expected",
    [
        (10, 4, 3, (7, 11)),
        (1, 1, 3, None),
        (0, 8, 3, (0, 5)),
        (5, 0, 2, None),
        (3, 3, 3, (0, 3)),
    ],
)
def test_superseded_window_range(prefix, new, window, expected):
    """The range the adapter demotes after a backup: what the old Python arithmetic gave."""
    start, stop = max(0, prefix - window), max(0, prefix + new - window)
    old = (start, stop) if stop > start else None
    assert old == expected
    assert _native.key_superseded_range(prefix, new, window) == expected


def test_junk_keys_are_outside_the_scheme():
    for junk in ["", "@", "plain-key", "x@zz.k", "x@0a", "x@0a.tp0", "x@0a.we ird"]:
        assert _native.key_pool_of(junk) == "other"
    assert _native.key_parse("x@0a.tp0") is None
    assert _native.key_group_of("plain-key") == "plain-key"


# ------------------------------------------------------------------ issue 28


def test_every_engines_keys_are_composed_and_grouped_by_the_scheme():
    """vLLM's and LMCache's keys are composed in Rust, byte for byte what the adapters wrote
    before (objects already stored keep their names), and each scheme names its own eviction
    groups: one per SGLang page, one per vLLM block, one per LMCache chunk (with its sidecar)."""
    ns = _native.key_vllm_namespace("Qwen/Qwen3-0.6B", "0123456789abcdef")
    assert ns == "vllm/Qwen_Qwen3-0.6B_0123456789abcdef"
    block = bytes(range(32))
    vkey = _native.key_vllm(ns, block, 1)
    assert vkey == f"{ns}/{block.hex()}_g1"
    assert _native.key_scheme_of(vkey) == "vllm" and _native.key_group_of(vkey) == vkey
    l2 = ["Qwen/Qwen3-0.6B@0@0@" + "ab" * 32, "Qwen/Qwen3-0.6B@0@0@" + "cd" * 32 + "@salt"]
    composed_l2 = _native.key_lmcache_l2(l2)
    assert composed_l2 == ["lmcache/" + k for k in l2]
    groups = {_native.key_group_of(k) for k in composed_l2}
    assert groups == set(composed_l2), "one group per chunk, not per model"
    legacy = "Qwen/Qwen3-0.6B@1@0@" + "ef" * 32 + "@bfloat16"
    chunk = _native.key_lmcache_legacy(legacy)
    meta = _native.key_lmcache_legacy(legacy, sidecar=True)
    assert (chunk, meta) == ("lmcache-v1/" + legacy, "lmcache-v1/" + legacy + ".meta")
    assert _native.key_group_of(meta) == _native.key_group_of(chunk) == chunk
    assert {_native.key_scheme_of(k) for k in [*composed_l2, chunk, meta]} == {"lmcache"}
    # The store's namespace prefixes are kept in front of the group.
    sep = chr(_native.NAMESPACE_SEPARATOR)
    assert sep == "\x1f"
    assert _native.key_group_of(f"team{sep}{composed_l2[0]}") == f"team{sep}{composed_l2[0]}"
    sg = f"team{sep}t/{PAGE}@{FP}.tp0.k"
    assert _native.key_group_of(sg) == f"team{sep}t/{PAGE}@"
    assert _native.key_scheme_of(sg) == "sglang"
    # Anything else is opaque and its own group.
    for key in ["plain", "a@b@c", "x@.k"]:
        assert _native.key_scheme_of(key) == "opaque" and _native.key_group_of(key) == key
    assert KeyLayout(tag="team").prefix == "team/" and KeyLayout().prefix == ""
    assert KeyLayout(tag="team").key(PAGE, f"@{FP}.k") == f"team/{PAGE}@{FP}.k"


def test_hit_policies_translate_once_for_the_adapter_and_the_linker():
    """``pool_query`` is the one translation of SGLang's hit policies (the HiCache adapter's
    batch_exists_v2 and the direct linker's lookup both call it). Where the two used to
    disagree it now gives the adapter's fail-closed answer: BLOCK_GROUPS without a size and an
    unknown policy are a miss (no objects asked for), never a verdict."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy

    from kvtier.sglang_keys import pool_query

    sfx = ["@fp.swa.k", "@fp.swa.v"]
    assert pool_query("swa", PoolHitPolicy.ALL_PAGES, sfx, None, None) == (
        ("swa", sfx, "all_pages", 0),
        None,
    )
    assert pool_query("swa", PoolHitPolicy.TRAILING_PAGES, sfx, ["a", "b", "c"], None)[0] == (
        "swa",
        sfx,
        "trailing_pages",
        3,
    )
    assert pool_query("swa", PoolHitPolicy.TRAILING_PAGES, sfx, [], None)[0][3] == 1
    assert pool_query("c4", PoolHitPolicy.BLOCK_GROUPS, sfx, None, 4) == (
        ("c4", sfx, "block_groups", 4),
        None,
    )
    for size in (None, 0, -2):
        query, problem = pool_query("c4", PoolHitPolicy.BLOCK_GROUPS, sfx, None, size)
        assert query == ("c4", [], "block_groups", 1) and "group_pages" in problem
    query, problem = pool_query("odd", "SOMETHING_NEW", sfx, None, None)
    assert query == ("odd", [], "all_pages", 0) and "unknown hit policy" in problem


def test_only_sglang_pages_have_an_sglang_page_hash():
    """KV events name SGLang pages only: a vLLM block or an LMCache chunk in the same store is
    no SGLang page (its hex block hash would otherwise be published as one)."""
    vkey = _native.key_vllm(_native.key_vllm_namespace("m", "0" * 16), bytes(range(16)), 0)
    lkey = _native.key_lmcache_l2(["m@0@0@" + "ab" * 32])[0]
    for key in [vkey, lkey, "plain"]:
        assert _native.key_page_hash(_native.key_group_of(key)) == ""
        assert event_hash(page_hash_of_group(_native.key_group_of(key))) is None
    assert page_hash_of_group(f"t/{PAGE}@") == PAGE
