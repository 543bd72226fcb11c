"""The layout fingerprint moved from Python to Rust (``kvtier_proto::keys::fingerprint``,
issue 16) without changing a single key: ``_native.key_fingerprint(facts)`` must equal what
the adapter computed before, ``hashlib.blake2b(repr(facts).encode(), digest_size=6)``, for
every fact the adapter can gather (synthetic corner cases of every type) and for the facts of
every real SGLang pool the test harness builds (HiCache host pools of every layout, the
DeepSeek-V4 group, and the linker's device pools and host twins of every kind).
"""

from __future__ import annotations

import enum
import hashlib

import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import PoolName

import kvtier_dev.harness.flows as cf
import kvtier_dev.harness.pools as sp
from kvtier import _native
from kvtier.sglang import KEY_FORMAT_VERSION, KvtierStore
from kvtier.sglang_keys import KeyLayout

DYNAMIC = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore"}
EMBEDDED = {"dram_capacity_bytes": "64MiB", "dram_prefault": False, "interface_v1": 1}


def reference(facts: tuple) -> str:
    """The fingerprint as the adapter computed it before issue 16 moved it to Rust."""
    return hashlib.blake2b(repr(facts).encode(), digest_size=6).hexdigest()


class Colour(enum.Enum):
    RED = "red"


class Level(enum.IntEnum):
    HIGH = 3


class Tag(str):
    pass


TEXTS = [
    "",
    "page_first",
    "'",
    '"',
    "'\"",
    "it's",
    'say "hi"',
    "\\",
    "a\\'b\\\"c",
    "\t\n\r\x00\x01\x1f\x7f",
    "deepseek-ai-DeepSeek-V3",
    "Mödel",
    "日本語モデル",
    "emoji 🙂",
    "\x80\x85\x9f\xa0\xad\xff",  # C1 controls, NBSP, soft hyphen: escaped by repr
    "\u200b\u2028\u2029\ufeff",  # format and separator characters: escaped
    "\ud800",  # a lone surrogate: repr escapes it
    "\U000e0001\U0010ffff",
    "x" * 300,
]

OTHERS = [
    None,
    0,
    1,
    -1,
    2**63,
    -(2**63) - 1,
    2**127 - 1,
    -(2**127),
    2**127,  # beyond i128: rendered by Python
    -(2**300),
    True,
    False,
    1.5,
    float("nan"),
    Colour.RED,
    Level.HIGH,  # an int subclass: its repr is not an int's
    Tag("page_first"),  # a str subclass: repr of a plain str, but must not be assumed so
    PoolName.SWA,
    torch.bfloat16,
    (),
    (7,),
    (None,),
    ((1,),),
    (1, (2, (3, "x'y")), None),
    (1171456, 65536, 0),
    [1, 2],  # a list, rendered by Python
    b"bytes",
]


@pytest.mark.parametrize("value", TEXTS + OTHERS, ids=repr)
def test_every_fact_type_alone_and_in_every_position(value):
    base = (
        KEY_FORMAT_VERSION,
        "zero-copy",
        "test-model",
        "kv",
        "MHATokenToKVPoolHost",
        None,
        "page_first",
        "torch.bfloat16",
        64,
        (1024, 1024),
        1,
        2,
        1,
    )
    cases = [(value,), (value, value)]
    cases += [base[:i] + (value,) + base[i + 1 :] for i in range(len(base))]
    for facts in cases:
        assert _native.key_fingerprint(facts) == reference(facts), facts


def test_none_in_every_position_and_empty_facts():
    base = (1, "flat-page", "", "swa", "T", None, None, "None", None, (0,), 1, None, 1)
    for i in range(len(base)):
        facts = base[:i] + (None,) + base[i + 1 :]
        assert _native.key_fingerprint(facts) == reference(facts)
    assert _native.key_fingerprint(()) == reference(())


def test_known_value_matches_the_rust_unit_test():
    facts = (
        1,
        "zero-copy",
        "deepseek-ai-DeepSeek-V3",
        "kv",
        "MLATokenToKVPoolHost",
        None,
        "page_first",
        "torch.bfloat16",
        64,
        (1171456,),
        1,
        None,
        1,
    )
    assert _native.key_fingerprint(facts) == "768057a6de9f" == reference(facts)


def test_bad_arguments_fail_cleanly():
    with pytest.raises(TypeError):
        _native.key_fingerprint(["not", "a", "tuple"])
    deep = 0
    for _ in range(40):
        deep = (deep,)
    with pytest.raises(ValueError, match="deeper"):
        _native.key_fingerprint((deep,))

    class Broken:
        def __repr__(self):
            raise RuntimeError("no repr")

    with pytest.raises(RuntimeError, match="no repr"):
        _native.key_fingerprint((Broken(),))


# --------------------------------------------------------------------------- real pools


@pytest.fixture
def recorded(monkeypatch):
    """Every facts tuple the adapter hashes while the test runs, and the fingerprint it used."""
    seen = []
    facts_of = KeyLayout.fingerprint_facts

    def recording(self, *args, **kwargs):
        facts = facts_of(self, *args, **kwargs)
        seen.append(facts)
        return facts

    monkeypatch.setattr(KeyLayout, "fingerprint_facts", recording)
    return seen


def check(seen, plans=()):
    assert seen, "no fingerprint was computed"
    expected = {reference(facts) for facts in seen}
    for facts in seen:
        assert _native.key_fingerprint(facts) == reference(facts), facts
    for plan in plans:
        for suffix in [*plan.suffixes, plan.page_suffix]:
            assert _native.key_parse(suffix)[2] in expected, suffix


# layer_first host pools are refused at registration, before any key is composed
# (test_store_semantics checks the refusal).
MHA_LAYOUTS = [layout for layout in sp.MHA_LAYOUTS if layout != "layer_first"]
MLA_LAYOUTS = [layout for layout in sp.MLA_LAYOUTS if layout != "layer_first"]


def store(**cfg):
    extra = {**DYNAMIC, **EMBEDDED}
    return KvtierStore(sp.make_storage_config(extra_config=extra, **cfg), {})


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"tp_rank": 1, "tp_size": 2, "model_name": 'org/It\'s "quoted" \\ Mödel'},
        {"pp_size": 2, "pp_rank": 1, "model_name": None},
    ],
    ids=["plain", "tp2-odd-model", "pp2-no-model"],
)
def test_mha_host_pools(recorded, layout, cfg):
    s = store(**cfg)
    s.register_mem_pool_host(sp.build_mha_host_pool(layout))
    check(recorded, s._plans.values())
    s.close()


@pytest.mark.parametrize("layout", MLA_LAYOUTS)
def test_mla_host_pools(recorded, layout):
    s = store(is_mla=True, tp_size=4, tp_rank=3)
    s.register_mem_pool_host(sp.build_mla_host_pool(layout))
    check(recorded, s._plans.values())
    s.close()


@pytest.mark.parametrize("layout", ["page_first", "layer_first"])
def test_deepseek_v4_group(recorded, layout):
    s = store(is_mla=True)
    cf.attach_backend(s, sp.build_dsv4_pool_group(layout))
    check(recorded, s._plans.values())
    s.close()


@pytest.mark.parametrize("kind", ["mha", "mla", "mha_swa", "dsa", "dsv4"])
def test_linker_pools_and_twins(recorded, kind):
    from kvtier_dev.harness import linker_flow as lf

    geometry = {
        "dsa": {"page_size": 64, "pages": 16},
        "dsv4": {"page_size": 256, "pages": 8, "window": 128},
    }.get(kind, {})
    built = lf.build(
        kind, extra={"dram_capacity_bytes": "64MiB", "dram_prefault": False}, **geometry
    )
    try:
        check(recorded)
        modes = {facts[1] for facts in recorded}
        assert modes & {"zero-copy", "linker"}, modes
    finally:
        built.close()
