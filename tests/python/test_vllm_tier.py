"""kvtier as a secondary tier of vLLM 0.34.0's OffloadingConnector (issue 19).

Real vLLM objects throughout (see _vllm_engine). Engine-level tests run the v1 ``Scheduler``
(KV cache manager, prefix hashing, ``OffloadingConnector`` in the scheduler role with
``TieringOffloadingSpec``, its tiering manager, CPU primary tier over a real
``/dev/shm/vllm_offload_*`` region and ``KvtierTier``) and the ``OffloadingConnector`` in the
worker role (deferred stores, loads into the registered KV cache): a request's blocks are
offloaded, the GPU prefix cache, GPU blocks and CPU primary tier are wiped, and the same prompt
loads them back from kvtier byte-exact while the forward computes only the tail; the same across
two instances sharing a ``kvtier serve`` and across two cluster nodes. Manager-level
tests drive ``TieringOffloadingManager`` directly (store cascade, lookup RETRY then HIT,
promotion, reset) for the eviction and failure cases.

Substituted, because there is no GPU, and only these: the copy worker (``MemcpyTieringSpec``
gives the worker role a memcpy worker; the stock one refuses non-CUDA devices) and the model
forward (deterministic bytes per block hash). Real kvtier: embedded stores, a real
``kvtier serve`` shared by two vLLM instances, a real ``kvtier master`` with two nodes.
"""

from __future__ import annotations

import glob
import json
import time

import pytest

import _vllm_engine as ve
import test_cluster as tc
import test_server_mode as sm

kvtier_bin = sm.kvtier_bin
cluster = tc.cluster

TIER = {"type": "KvtierTier", "module_path": "kvtier.vllm"}


@pytest.fixture(autouse=True)
def _no_leftover_regions():
    ve.remove_leftover_regions()
    yield
    ve.remove_leftover_regions()


@pytest.fixture
def engines():
    made = []

    def make(*args, **kw):
        e = ve.Engine(*args, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        if e.manager is not None:
            e.close()


def exact(engine, got, keys):
    return [k for k in keys if got[k] != ve.chunk_bytes(k, engine.stride)]


def test_factory_builds_the_tier_and_rejects_unknown_kvtier_keys(engines):
    from kvtier.vllm import KvtierTier

    e = engines([dict(TIER, dram_capacity_bytes=32 << 20)])
    assert isinstance(e.tier, KvtierTier)
    assert e.tier.tier_type == "KvtierTier"
    assert e.tier._store.mode == "embedded"
    assert e.tier.store_key(ve.request_keys("a", 1)[0]).startswith("vllm/kvtier-test_llama-1l_")
    with pytest.raises(ValueError, match="dram_capacity_byte"):
        ve.Engine([dict(TIER, dram_capacity_byte=1)], engine_id="kvtier-test-badkey")
    # The failed construction left no shared region behind.
    assert not glob.glob("/dev/shm/vllm_offload_kvtier-test-badkey*")


def test_store_wipe_and_load_back_byte_exact(engines):
    e = engines([dict(TIER, dram_capacity_bytes=32 << 20)])
    keys = ve.request_keys("store-load", 24)
    e.offload(keys)
    assert e.tier.stats()["puts"] == 24
    e.wipe_primary()
    got = e.fetch(keys)
    assert not exact(e, got, keys)
    assert e.tier.stats()["hits"] >= 24
    # A prompt never stored misses in every tier.
    other = ve.request_keys("never", 4)
    assert all(v is None for v in e.fetch(other).values())


def test_lookup_is_asynchronous_retry_then_hit(engines):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext

    e = engines([dict(TIER, dram_capacity_bytes=32 << 20)])
    keys = ve.request_keys("retry", 2)
    e.offload(keys)
    e.wipe_primary()
    ctx = ReqContext(req_id="probe")
    tier = e.tier
    assert tier.lookup(keys[0], ctx) is LookupResult.RETRY  # probe queued, not yet run
    deadline = time.monotonic() + 10
    while True:  # one scheduler step per round: the step end posts and applies probes
        tier.on_schedule_end(None)
        if (r := tier.lookup(keys[0], ctx)) is not LookupResult.RETRY:
            break
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert r is LookupResult.HIT
    tier.on_request_finished(ctx)


# ------------------------------------------------------------------ the v1 Scheduler, both roles

# 6 full blocks and 4 more tokens: vLLM can load at most 96 tokens, the forward computes 4.
PROMPT = list(range(1, 16 * 6 + 5))
FULL_BLOCKS = 6


@pytest.fixture
def instances(tmp_path):
    made = []

    def make(tiers, **kw):
        v = ve.VllmInstance(tmp_path, tiers, **kw)
        made.append(v)
        return v

    yield make
    for v in made:
        v.close()


def check_loaded_from_kvtier(v, req, seen):
    """Every full block holds its bytes, and the forward computed only the tail: the blocks
    came through the connector (vLLM's load path), not from recomputation."""
    want = v.expected(req)
    assert [i for i in range(FULL_BLOCKS) if seen.get(i) != want[i]] == []
    assert v.computed[req.request_id] == len(PROMPT) - FULL_BLOCKS * 16


def test_scheduler_offloads_to_kvtier_and_loads_back_byte_exact(instances):
    v = instances([dict(TIER, dram_capacity_bytes=32 << 20)])
    req, seen = v.run(PROMPT)
    assert v.computed[req.request_id] == len(PROMPT)  # cold: all computed
    assert all(seen[i] == v.expected(req)[i] for i in range(FULL_BLOCKS))
    assert v.tier.stats()["puts"] == FULL_BLOCKS
    v.wipe()  # GPU prefix cache, GPU blocks and the CPU primary tier are gone
    hits = v.tier.stats()["hits"]
    req2, seen2 = v.run(PROMPT)
    check_loaded_from_kvtier(v, req2, seen2)
    assert v.tier.stats()["hits"] - hits == FULL_BLOCKS


def test_two_vllm_instances_share_one_kvtier_serve(instances, kvtier_bin, tmp_path):
    served = sm.Served(kvtier_bin, tmp_path)
    try:
        cfg = dict(TIER, server_socket=served.socket)
        a = instances([cfg])
        b = instances([cfg])
        assert a.tier._store.mode == "server" and b.tier._store.mode == "server"
        # Each instance's shared region file is mapped by the server: no staging copy.
        assert a.tier._store.zero_copy_regions() == 1 and b.tier._store.zero_copy_regions() == 1
        a.run(PROMPT)
        wait_objects = time.monotonic() + 10
        while sum(s["objects"] for s in served.stat()["stores"].values()) < FULL_BLOCKS:
            assert time.monotonic() < wait_objects
            time.sleep(0.01)
        req, seen = b.run(PROMPT)  # B never computed this prompt
        check_loaded_from_kvtier(b, req, seen)
    finally:
        for v in (a, b):
            v.close()
        served.stop()


def test_models_do_not_share_chunks(engines, kvtier_bin, tmp_path):
    served = sm.Served(kvtier_bin, tmp_path)
    try:
        cfg = dict(TIER, server_socket=served.socket)
        a = engines([cfg])
        b = engines([cfg], model="kvtier-test/other-model")
        keys = ve.request_keys("same-prompt", 4)
        a.offload(keys)
        assert all(v is None for v in b.fetch(keys).values())
    finally:
        served.stop()


def test_cluster_read_on_another_node(instances, cluster):
    """Two vLLM hosts on a kvtier cluster: the prompt computed on host A (node-a) is loaded on
    host B (node-b) through vLLM's scheduler, from node-a's store."""
    c = cluster()
    node_a = c.add_node("node-a", "127.0.0.2")
    c.add_node("node-b", "127.0.0.3")
    c.master.wait_nodes(["node-a", "node-b"])
    a = instances([dict(TIER, **c.store_config("node-a"))])
    b = instances([dict(TIER, **c.store_config("node-b"))])
    assert a.tier._store.mode == "cluster"
    a.run(PROMPT)
    assert len(node_a.keys()) == FULL_BLOCKS  # stored on the writer's node
    req, seen = b.run(PROMPT)
    check_loaded_from_kvtier(b, req, seen)


def test_eviction_under_load_misses_cleanly_and_serves_the_rest(engines):
    # kvtier holds 16 chunks of 64 KiB; 96 are stored through it.
    e = engines([dict(TIER, dram_capacity_bytes=1 << 20, dram_block_size=65536)])
    keys = ve.request_keys("evict", 96)
    for i in range(0, 96, 8):
        e.offload(keys[i : i + 8])
    stats = e.tier.stats()
    assert stats["puts"] == 96
    e.wipe_primary()
    got = e.fetch(keys[-8:])
    assert not exact(e, got, keys[-8:]), "the most recent chunks must survive"
    old = e.fetch(keys[:8])
    assert all(v is None for v in old.values()), "the oldest chunks were evicted"


def test_a_failing_tier_fails_jobs_not_vllm(engines, kvtier_bin, tmp_path):
    served = sm.Served(kvtier_bin, tmp_path)
    e = engines([dict(TIER, server_socket=served.socket)])
    keys = ve.request_keys("fail", 8)
    e.offload(keys[:4])
    served.proc.kill()
    served.proc.wait()
    served.stop()
    # Stores now fail inside kvtier: the jobs complete failed, vLLM's manager goes on.
    e.offload(keys[4:])
    assert e.tier._queue.pending() == 0
    e.wipe_primary()
    got = e.fetch(keys)
    assert all(v is None for v in got.values())


def test_shutdown_drains_and_releases_the_region(engines):
    e = engines([dict(TIER, dram_capacity_bytes=32 << 20)])
    keys = ve.request_keys("shutdown", 32)
    e.offload(keys)
    tier = e.tier
    e.close()
    e.manager = None
    assert tier._closed and tier._queue.closed
    assert tier._primary_kv_view is None
    assert not glob.glob(f"/dev/shm/vllm_offload_{e.config.engine_id}*")


def test_config_a_user_pastes_is_accepted_by_vllm():
    """The README's kv_connector_extra_config, parsed as vLLM does (JSON) and built."""
    extra = json.loads(
        '{"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 33554432,'
        ' "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.vllm",'
        ' "dram_capacity_bytes": 33554432}]}'
    )
    tiers = extra.pop("secondary_tiers")
    cfg = ve.offloading_config(tiers, extra.pop("cpu_bytes_to_use"), 65536)
    from vllm.v1.kv_offload.factory import OffloadingSpecFactory

    spec = OffloadingSpecFactory.create_spec(cfg)
    manager = spec.get_manager()
    try:
        assert type(manager.secondary_tiers[0]).__name__ == "KvtierTier"
    finally:
        manager.shutdown()


# ------------------------------------------------------------------ issue 31: the tier's boundary


def test_tier_errors_never_reach_the_engine(instances, tmp_path):
    """The v1 Scheduler with a KvtierTier whose kvtier calls all raise (``_vllm_faulty_tier``:
    lookups, store/load submissions, store bookkeeping, every other completion poll): each
    request still finishes (recomputed, never loaded), vLLM's step never sees an exception, and
    once the faults stop the same engine loads from kvtier again."""
    fault = tmp_path / "fault"
    v = instances(
        [
            {
                "type": "FaultyKvtierTier",
                "module_path": "_vllm_faulty_tier",
                "fault_file": str(fault),
                "dram_capacity_bytes": 32 << 20,
            }
        ]
    )
    req, _ = v.run(PROMPT)  # stored while healthy
    fault.write_text("on")
    v.wipe()
    req2, seen2 = v.run(PROMPT)  # lookups raise: a miss, the forward computes every token
    assert v.computed[req2.request_id] == len(PROMPT)
    assert all(seen2[i] == v.expected(req2)[i] for i in range(FULL_BLOCKS))
    other = [t + 1000 for t in PROMPT]
    req3, _ = v.run(other)  # store submissions raise: failed jobs, the request finishes
    assert v.computed[req3.request_id] == len(other)
    assert v.tier._jobs == {} and not v.tier.has_pending_work()
    fault.unlink()
    v.wipe()
    req4, seen4 = v.run(PROMPT)
    check_loaded_from_kvtier(v, req4, seen4)


def test_works_without_mark_present_as_in_vllm_0_32(instances, monkeypatch):
    """vLLM 0.32's AsyncLookupManager has no ``mark_present`` (its absence killed 0.32's engine
    on the first store before issue 31): the tier detects it and stores, lookups and loads run
    as before."""
    from kvtier.vllm import _KvtierLookup

    monkeypatch.setattr(_KvtierLookup, "HAS_MARK_PRESENT", False)
    monkeypatch.delattr(_KvtierLookup.__mro__[1], "mark_present")
    v = instances([dict(TIER, dram_capacity_bytes=32 << 20)])
    v.run(PROMPT)
    v.wipe()
    req, seen = v.run(PROMPT)
    check_loaded_from_kvtier(v, req, seen)


def test_a_failed_load_never_resolves_a_pending_probe(engines):
    """vLLM 0.32's ``mark_miss`` forces any cached probe to RESOLVED, which trips the phase
    asserts of ``flush``/``drain_results`` when the probe was still pending; the tier passes it
    only resolved keys."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.async_lookup import LookupPhase

    e = engines([dict(TIER, dram_capacity_bytes=32 << 20)])
    keys = ve.request_keys("pending", 2)
    lk = e.tier._lookup
    calls = []
    real = lk.mark_miss
    lk.mark_miss = lambda ks: (calls.append(list(ks)), real(ks))
    ctx = ReqContext(req_id="probe")
    assert lk.lookup(keys[0], ctx) is None  # PENDING
    lk.missed([keys[0]])
    assert calls == []  # not passed on
    assert lk._lookup_state[keys[0]].phase is LookupPhase.PENDING
    lk.flush()  # would assert if the phase had been forced
    deadline = time.monotonic() + 10
    while lk.lookup(keys[0], ctx) is None:
        lk.flush()
        assert time.monotonic() < deadline
        time.sleep(0.001)
    lk.missed([keys[0]])  # resolved now: passed on
    assert calls == [[keys[0]]]
    lk.cleanup("probe")
