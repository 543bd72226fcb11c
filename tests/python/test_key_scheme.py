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
from kvtier.sglang import KEY_FORMAT_VERSION, KvtierStore

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
    """What ``KvtierStore._rank_tag`` reads from the adapter (a real instance needs SGLang
    pools; the key helpers read only these attributes)."""
    replicated, tp, pp, ppr, cp, cpr, dcp, dcpr = layout
    fake = types.SimpleNamespace(
        _tp_rank=tp,
        _pp_size=pp,
        _pp_rank=ppr,
        _cp_size=cp,
        _cp_rank=cpr,
        _dcp_size=dcp,
        _dcp_rank=dcpr,
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
        rank_tag = KvtierStore._rank_tag(fake, replicated)
        names = KvtierStore._component_names(base, count, mamba_pool(shape))
        assert len(names) == count
        for name in names:
            suffix = _native.key_suffix(FP, rank_tag, name)
            key = _native.key_compose(tag, PAGE, suffix)
            out.append((key, tag, rank_tag, name, pool, layout))
    return out


def test_rank_tags_and_names_match_the_documented_scheme():
    assert KEY_FORMAT_VERSION == 1
    fake, _ = adapter((False, 3, 2, 1, 1, 0, 4, 2))
    assert KvtierStore._rank_tag(fake, False) == ".tp3.pp1.dcp2"
    assert KvtierStore._rank_tag(fake, True) == ".pp1.dcp2"
    assert KvtierStore._rank_tag(fake, False, 5) == ".tp5.pp1.dcp2"
    assert KvtierStore._component_names(None, 2) == ["k", "v"]
    assert KvtierStore._component_names(None, 1) == ["kv"]
    assert KvtierStore._component_names("swa", 3) == ["swa.c0", "swa.c1", "swa.c2"]
    assert KvtierStore._component_names("mamba", 3, mamba_pool((2, True))) == [
        "mamba.temporal",
        "mamba.conv0",
        "mamba.conv1",
    ]
    # A Mamba shape that does not match the count falls back to the generic names.
    assert KvtierStore._component_names("mamba", 2, mamba_pool((2, True))) == [
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
