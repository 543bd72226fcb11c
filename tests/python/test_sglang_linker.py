"""kvtier as SGLang's direct L3 (``kvtier.sglang_linker.KvtierLinker``, issue 18), driven
through SGLang 0.5.23's real objects on CPU: the dynamic factory chain
(``registry.create_tree_cache``), ``UnifiedRadixCache`` with both tree cores, SGLang's linker
wrapper, real device pools and allocators, and the scheduler's calls in order
(``kvtier.harness.linker_flow``)."""

from __future__ import annotations

import os

import pytest
import torch

from kvtier.harness import linker_flow as lf

# SGLang JIT-builds its page hash extension with ninja from the venv.
os.environ["PATH"] = f"{os.path.dirname(os.path.abspath(os.sys.executable))}:{os.environ['PATH']}"

EMBEDDED = {"dram_capacity_bytes": "64MiB", "dram_prefault": False}


def _exact(want, got):
    return len(want) == len(got) and all(torch.equal(a, b) for a, b in zip(want, got))


@pytest.fixture
def built():
    made = []

    def make(kind="mha", **kw):
        kw.setdefault("extra", EMBEDDED)
        b = lf.build(kind, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


@pytest.mark.parametrize("tree_core", ["python", "rust"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_restore_is_byte_exact(built, kind, tree_core):
    b = built(kind, tree_core=tree_core)
    assert type(b.linker).__name__ == "KvtierLinker" and b.linker.view == "kvtier"
    toks = lf.tokens_for(1, 6, b.page_size)
    slots = lf.produce(b, toks, seed=11)
    want = lf.read_slots(b, slots)
    lf.wait_offloads(b)
    first = b.linker.stats()
    assert first["objects_written"] > 0 and first["objects_skipped"] == 0
    lf.evict_all(b)
    lf.zero_all(b)
    r = lf.restore(b, "r1", toks)
    assert r.device_prefix_len == 0 and r.host_hit_length == len(toks) and r.loaded == len(toks)
    assert r.failed == []
    assert _exact(want, lf.read_slots(b, r.indices))
    # The loaded tail is offloaded again after its re-insert: an existence check, no copy.
    lf.wait_offloads(b)
    after = b.linker.stats()
    assert after["objects_written"] == first["objects_written"]
    assert after["objects_skipped"] == first["objects_written"]
    assert after["layers_loaded"] == b.num_layers
