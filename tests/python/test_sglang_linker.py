"""kvtier as SGLang's direct L3 (``kvtier.sglang_linker.KvtierLinker``, issue 18), driven
through SGLang 0.5.23's real objects on CPU: the dynamic factory chain
(``registry.create_tree_cache``), ``UnifiedRadixCache`` with both tree cores, SGLang's linker
wrapper, real device pools and allocators, and the scheduler's calls in order
(``kvtier_dev.harness.linker_flow``). Embedded, ``kvtier serve`` and cluster modes; HiCache
interop on one store."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from kvtier_dev.harness import linker_flow as lf

import test_cluster as tc
import test_server_mode as sm

kvtier_bin = sm.kvtier_bin
cluster = tc.cluster

# SGLang JIT-builds its page hash extension with ninja from the venv.
os.environ["PATH"] = f"{os.path.dirname(os.path.abspath(sys.executable))}:{os.environ['PATH']}"

EMBEDDED = {"dram_capacity_bytes": "64MiB", "dram_prefault": False}

# kind -> build kwargs (DSA needs 64-token pages; DeepSeek-V4 its real 256-token pages and
# 128-token window).
GEOMETRY = {
    "mha": {},
    "mla": {},
    "mha_swa": {},
    "dsa": {"page_size": 64, "pages": 16},
    "dsv4": {"page_size": 256, "pages": 8, "window": 128},
}


@pytest.fixture
def built():
    made = []

    def make(kind="mha", **kw):
        kw.setdefault("extra", EMBEDDED)
        for k, v in GEOMETRY[kind].items():
            kw.setdefault(k, v)
        b = lf.build(kind, **kw)
        made.append(b)
        return b

    yield make
    for b in made:
        b.close()


def _round_trip(b, pages=4, seed=11):
    """Produce ``pages`` pages, offload them, drop them from the device, restore."""
    toks = lf.tokens_for(seed, pages, b.page_size)
    slots = lf.produce(b, toks, seed=seed)
    want = lf.read_slots(b, slots)
    lf.wait_offloads(b)
    lf.evict_all(b)
    lf.zero_all(b)
    r = lf.restore(b, f"r{seed}", toks)
    return toks, want, r


@pytest.mark.parametrize(
    "kind,tree_core",
    [
        ("mha", "python"),
        ("mha", "rust"),
        ("mla", "python"),
        ("mla", "rust"),
        ("mha_swa", "python"),
        ("mha_swa", "rust"),
        ("dsa", "python"),
        ("dsa", "rust"),
        ("dsv4", "python"),
        ("dsv4", "rust"),
    ],
)
def test_restore_is_byte_exact(built, kind, tree_core):
    b = built(kind, tree_core=tree_core)
    assert type(b.linker).__name__ == "KvtierLinker"
    assert b.linker.view == ("sglang" if kind in ("dsa", "dsv4") else "kvtier")
    pages = 3 if kind == "dsv4" else 4
    toks = lf.tokens_for(1, pages, b.page_size)
    slots = lf.produce(b, toks, seed=11)
    want = lf.read_slots(b, slots)
    lf.wait_offloads(b)
    first = b.linker.stats()
    assert first["objects_written"] > 0 and first["objects_skipped"] == 0
    lf.evict_all(b)
    lf.zero_all(b)
    r = lf.restore(b, "r1", toks)
    assert r.device_prefix_len == 0 and r.host_hit_length == len(toks) == r.loaded
    assert r.failed == []
    got = lf.read_slots(b, r.indices)
    assert len(got) == len(want) and got == want
    # The loaded tail is offloaded again after its re-insert: an existence check, no copy.
    lf.wait_offloads(b)
    after = b.linker.stats()
    assert after["objects_written"] == first["objects_written"]
    assert after["objects_skipped"] > 0
    assert after["layers_loaded"] == b.linker.num_layers


def test_partial_device_hit_loads_only_the_tail(built):
    b = built("mha")
    toks = lf.tokens_for(2, 6, b.page_size)
    want = lf.read_slots(b, lf.produce(b, toks, seed=2))
    lf.wait_offloads(b)
    lf.evict_all(b)
    lf.zero_all(b)
    head = toks[: 2 * b.page_size]
    r1 = lf.restore(b, "head", head)
    assert r1.loaded == len(head)
    lf.wait_offloads(b)
    loaded_before = b.linker.stats()["bytes_loaded"]
    r2 = lf.restore(b, "all", toks)
    assert r2.device_prefix_len == len(head)
    assert r2.loaded == len(toks) - len(head) and r2.failed == []
    assert lf.read_slots(b, r2.indices) == want
    # Only the four tail pages crossed from the store.
    assert b.linker.stats()["bytes_loaded"] - loaded_before == 2 * loaded_before


def test_missing_last_page_shortens_the_hit(built):
    b = built("mha")
    toks = lf.tokens_for(3, 5, b.page_size)
    want = lf.read_slots(b, lf.produce(b, toks, seed=3))
    lf.wait_offloads(b)
    lf.evict_all(b)
    lf.zero_all(b)
    last = lf.page_keys(b, toks)[-1]
    keys = [b.linker._key(last, o) for o in b.linker._objects["kv"]]
    assert b.linker.store._store.remove_keys(keys) == len(keys)
    r = lf.restore(b, "short", toks)
    assert r.host_hit_length == r.loaded == 4 * b.page_size and r.failed == []
    assert lf.read_slots(b, r.indices) == want[: len(want) * 4 // 5]


def test_failing_store_aborts_the_request(built):
    b = built("mha")
    toks = lf.tokens_for(4, 4, b.page_size)
    lf.produce(b, toks, seed=4)
    lf.wait_offloads(b)
    lf.evict_all(b)

    def vanish(_req):
        # The pages disappear between lookup and load (evicted by another writer).
        b.linker.store._store.clear()

    r = lf.restore(b, "doomed", toks, before_load=vanish)
    assert r.loaded == len(toks)
    assert [req.rid for req in r.failed] == ["doomed"]
    assert r.req.skip_radix_cache_insert
    assert b.linker.stats()["load_failures"] == 1
    # Nothing of the failed request reached the tree.
    assert (
        b.cache.match_prefix(
            lf.MatchPrefixParams(key=lf.RadixKey(lf.array("q", toks)))
        ).device_prefix_len
        == 0
    )


def test_offload_results_come_back_in_call_order(built):
    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

    b = built("mha")
    linker = b.linker
    slots = lf.alloc(b, 2 * b.page_size)
    lf.fill_slots(b, slots, seed=5)
    keys = ["order-a", "order-b"]

    def transfer(i):
        idx = slots[i * b.page_size : (i + 1) * b.page_size].to(torch.int64)
        return [PoolTransfer(name=PoolName.KV, device_indices=idx, keys=[keys[i]])]

    assert linker.offload(transfer(0))
    # Memory kvtier never registered: refused, and its result keeps its place.
    linker.core.submit_offload([("order-bad", [(4096, 64)])], None)
    assert linker.offload(transfer(1))
    linker.core.submit_offload([], None)
    linker.core.drain()
    assert linker.num_completed_offloads() == 4
    assert [linker.pop_completed_offload() for _ in range(4)] == [True, False, True, True]
    assert linker.num_completed_offloads() == 0


def test_server_mode_round_trip(built, kvtier_bin, tmp_path):
    served = sm.Served(kvtier_bin, tmp_path)
    try:
        b = built("mha", extra={"server_socket": served.socket})
        assert b.linker.store._store.mode == "server"
        toks, want, r = _round_trip(b, seed=6)
        assert r.loaded == len(toks) and r.failed == []
        assert lf.read_slots(b, r.indices) == want
    finally:
        b.close()
        served.stop()


def test_cluster_decode_host_loads_what_prefill_offloaded(built, cluster):
    c = cluster()
    c.add_node("prefill", "127.0.0.1")
    c.add_node("decode", "127.0.0.1")
    c.master.wait_nodes(["decode", "prefill"])
    a = built("mla", extra=c.store_config("prefill"))
    assert a.linker.store._store.mode == "cluster"
    toks = lf.tokens_for(7, 4, a.page_size)
    want = lf.read_slots(a, lf.produce(a, toks, seed=7))
    lf.wait_offloads(a)
    a.close()
    # Another process's client on another node: a fresh cache, empty device pools.
    d = built("mla", extra=c.store_config("decode"))
    r = lf.restore(d, "decode", toks)
    assert r.host_hit_length == r.loaded == len(toks) and r.failed == []
    assert lf.read_slots(d, r.indices) == want


@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_hicache_adapter_and_linker_share_pages(built, kvtier_bin, tmp_path, kind):
    """One ``kvtier serve``: a page the linker offloads is a HiCache hit with the same bytes,
    and a page HiCache backs up is restored by the linker."""
    from kvtier_dev.harness import pools
    from kvtier.sglang import KvtierStore

    served = sm.Served(kvtier_bin, tmp_path)
    try:
        b = built(kind, extra={"server_socket": served.socket})
        geo = dict(page_size=b.page_size, layer_num=b.num_layers)
        if kind == "mha":
            host = pools.build_mha_host_pool("page_first_direct", head_num=2, head_dim=16, **geo)
        else:
            host = pools.build_mla_host_pool(
                "page_first_direct", kv_lora_rank=32, qk_rope_head_dim=16, **geo
            )
        store = KvtierStore(
            pools.make_storage_config(
                is_mla=kind == "mla",
                model_name="dummy",
                extra_config={"server_socket": served.socket, "interface_v1": 1},
            ),
            host,
        )
        try:
            # Linker -> HiCache.
            toks = lf.tokens_for(8, 3, b.page_size)
            want = lf.read_slots(b, lf.produce(b, toks, seed=8))
            lf.wait_offloads(b)
            hashes = lf.page_keys(b, toks)
            assert store.batch_exists(hashes) == 3
            hidx = pools.alloc_indices(host, 3)
            assert store.batch_get_v1(hashes, hidx) == [True] * 3
            got = b"".join(c for page in pools.read_page_components(host, hidx) for c in page)
            # A HiCache page_first_direct page is K of every layer, then V of every layer:
            # the linker's k and v objects, the order read_slots reads them in.
            assert got == b"".join(want)
            # HiCache -> linker.
            toks2 = lf.tokens_for(9, 3, b.page_size)
            hashes2 = lf.page_keys(b, toks2)
            hidx2 = pools.alloc_indices(host, 3)
            pools.fill_pages(host, hidx2, seed=9)
            pages = b"".join(c for page in pools.read_page_components(host, hidx2) for c in page)
            assert store.batch_set_v1(hashes2, hidx2) == [True] * 3
            r = lf.restore(b, "from-hicache", toks2)
            assert r.loaded == len(toks2) and r.failed == []
            assert b"".join(lf.read_slots(b, r.indices)) == pages
        finally:
            store.close()
    finally:
        b.close()
        served.stop()


@pytest.mark.parametrize("kind", ["mha", "mha_swa", "dsa"])
def test_staging_linker_restore_is_byte_exact(built, kind):
    """The accelerator path (pinned staging + torch copies on a side stream), run on CPU
    pools: kvtier only ever touches staging memory."""
    b = built(kind, linker="KvtierStagingLinker")
    assert type(b.linker).__name__ == "KvtierStagingLinker"
    toks, want, r = _round_trip(b, seed=12)
    assert r.loaded == len(toks) and r.failed == []
    assert lf.read_slots(b, r.indices) == want
    lf.wait_offloads(b)
    stats = b.linker.stats()
    assert stats["objects_skipped"] > 0 and stats["layers_loaded"] == b.linker.num_layers
    # Device pools were never registered with kvtier: only staging, released after use.
    assert b.linker._native.regions() == []
