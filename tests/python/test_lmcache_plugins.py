"""kvtier as LMCache 0.5.6 storage through both plugin kinds (issue 19), with LMCache's own
objects on CPU (it picks ``StubCPUDevice``):

* native L2 plugin: the multi-process ``lmcache.v1.distributed.StorageManager`` (L1 manager,
  store and prefetch controllers) builds ``NativeConnectorL2Adapter`` over
  ``kvtier.lmcache.KvtierL2Connector`` from a ``native_plugin`` config; chunks written to L1
  reach kvtier, L1 is dropped, a prefetch brings them back from L2 byte-exact;
* legacy remote plugin: the non-MP ``StorageManager`` (``LocalCPUBackend`` + ``RemoteBackend``
  through ``ConnectorManager``) loads ``KvtierConnectorAdapter`` from ``remote_storage_plugins``;
  put, drop the local CPU copy, get back byte-exact (with and without chunk metadata);
* ``LMCacheEngine`` (``MockGPUConnector``: it moves no KV bytes, so bytes are checked at the
  storage-manager level above) store / lookup / retrieve served by kvtier after the local CPU
  tier is cleared.
"""

from __future__ import annotations

import hashlib
import time

import pytest
import torch

import test_server_mode as sm

kvtier_bin = sm.kvtier_bin


def fill(mv: memoryview, seed: bytes) -> bytes:
    mv = mv.cast("B") if mv.format != "B" else mv
    data = (hashlib.sha256(seed).digest() * (len(mv) // 32 + 1))[: len(mv)]
    mv[:] = data
    return data


def wait(cond, what, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.005)


# ------------------------------------------------------------------ native L2 plugin


def mp_storage_manager(adapter_params):
    from lmcache.v1.distributed.config import (
        EvictionConfig,
        L1ManagerConfig,
        L1MemoryManagerConfig,
        StorageManagerConfig,
    )
    from lmcache.v1.distributed.l2_adapters.config import L2AdaptersConfig
    from lmcache.v1.distributed.l2_adapters.native_plugin_l2_adapter import (
        NativePluginL2AdapterConfig,
    )
    from lmcache.v1.distributed.storage_manager import StorageManager

    l2 = NativePluginL2AdapterConfig.from_dict(
        {
            "type": "native_plugin",
            "module_path": "kvtier.lmcache",
            "class_name": "KvtierL2Connector",
            "adapter_params": adapter_params,
        }
    )
    cfg = StorageManagerConfig(
        l1_manager_config=L1ManagerConfig(
            memory_config=L1MemoryManagerConfig(
                size_in_bytes=64 << 20, use_lazy=False, init_size_in_bytes=64 << 20
            )
        ),
        eviction_config=EvictionConfig(eviction_policy="LRU"),
        l2_adapter_config=L2AdaptersConfig([l2]),
    )
    return StorageManager(cfg)


def write_l1(mgr, keys, layout):
    objs = mgr.reserve_write(keys, layout)
    assert len(objs) == len(keys)
    want = {k: fill(memoryview(objs[k].byte_array), k.chunk_hash) for k in keys}
    mgr.finish_write(keys)
    return want


def drop_l1(mgr, keys):
    deleted = 0

    def gone():
        nonlocal deleted
        deleted += mgr.delete_l1_keys(keys)[0]  # locked while L2 stores them: retry
        return deleted == len(keys)

    wait(gone, "L1 keys deletable")


def prefetch(mgr, keys, layout):
    from lmcache.v1.distributed.api import GroupedObjectKeys, PrefetchTaskSpec

    handle = mgr.submit_prefetch_task(
        PrefetchTaskSpec(
            key_groups=[GroupedObjectKeys(keys=keys, object_group_id=0, layout_desc=layout)]
        )
    )
    result = None

    def done():
        nonlocal result
        result = mgr.query_prefetch_status(handle)
        return result is not None

    wait(done, "prefetch")
    return result


def object_keys(n, tag):
    from lmcache.v1.distributed.api import ObjectKey

    return [
        ObjectKey(
            chunk_hash=hashlib.sha256(f"{tag}{i}".encode()).digest(), model_name="m", kv_rank=0
        )
        for i in range(n)
    ]


def layout():
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    return MemoryLayoutDesc(shapes=[torch.Size([16, 2, 512])], dtypes=[torch.bfloat16])


def test_native_plugin_store_drop_l1_prefetch_byte_exact():
    mgr = mp_storage_manager({"dram_capacity_bytes": 64 << 20})
    try:
        adapter = mgr.l2_adapters()[0][1]
        conn = adapter._client
        assert type(conn).__name__ == "KvtierL2Connector"
        keys, lay = object_keys(8, "native"), layout()
        want = write_l1(mgr, keys, lay)
        wait(lambda: conn.store.stats()["objects"] == 8, "8 objects in kvtier")
        drop_l1(mgr, keys)
        result = prefetch(mgr, keys, lay)
        assert result.hit_cells[0].count_leading_ones() == 8
        assert str(result.l2_hit_cells[0]) == "1" * 8 and str(result.l1_hit_cells[0]) == "0" * 8
        with mgr.read_prefetched_results(keys) as got:
            assert got is not None
            assert all(
                bytes(memoryview(o.byte_array).cast("B")) == want[k] for k, o in zip(keys, got)
            )
        mgr.finish_read_prefetched(keys)
        # Unknown chunks are L2 misses, not errors.
        assert prefetch(mgr, object_keys(2, "absent"), lay).hit_cells[0].count_leading_ones() == 0
    finally:
        mgr.close()


def test_native_connector_contract_and_eventfd():
    """The interface LMCache's adapter requires, driven as its demultiplexer does (poll on
    the eventfd, then drain), including failures that complete instead of raising."""
    import select

    from kvtier.lmcache import KvtierL2Connector

    c = KvtierL2Connector(dram_capacity_bytes=8 << 20, threads=2, queue_capacity=4)
    try:
        poller = select.poll()
        poller.register(c.event_fd(), select.POLLIN)
        src = [bytearray(hashlib.sha256(bytes([i])).digest() * 128) for i in range(3)]
        keys = [f"m@00000000@0@{i:064x}" for i in range(3)]
        done = {}

        def collect(fid):
            while fid not in done:
                assert poller.poll(5000), "no eventfd wake-up"
                for comp in c.drain_completions():
                    done[comp[0]] = comp
            return done.pop(fid)

        _, ok, err, bools = collect(c.submit_batch_set(keys, src))
        assert ok and err == "" and bools == [True] * 3
        _, ok, _, bools = collect(c.submit_batch_exists(keys + ["m@00000000@0@ff"]))
        assert bools == [True, True, True, False]
        dst = [bytearray(4096) for _ in range(3)] + [bytearray(4096)]
        _, ok, _, bools = collect(c.submit_batch_get(keys + ["m@00000000@0@ff"], dst))
        assert bools == [True, True, True, False] and not ok
        assert dst[:3] == src
        # A wrong-size destination fails that key with a named error.
        _, ok, err, bools = collect(c.submit_batch_get(keys[:1], [bytearray(10)]))
        assert not ok and bools == [False] and err
        _, ok, _, bools = collect(c.submit_batch_delete(keys[:2]))
        assert bools == [True, True]
        _, _, _, bools = collect(c.submit_batch_exists(keys))
        assert bools == [False, False, True]
        # Nothing pending: the eventfd was reset by the drain.
        assert not poller.poll(0)
    finally:
        c.close()
    with pytest.raises(ValueError, match="dram_capacity_byte"):
        KvtierL2Connector(dram_capacity_byte=1)


def test_native_plugin_through_a_shared_kvtier_serve(kvtier_bin, tmp_path):
    served = sm.Served(kvtier_bin, tmp_path)
    try:
        a = mp_storage_manager({"server_socket": served.socket})
        try:
            keys, lay = object_keys(4, "served"), layout()
            want = write_l1(a, keys, lay)
            wait(lambda: sum(s["objects"] for s in served.stat()["stores"].values()) == 4, "stored")
        finally:
            a.close()
        b = mp_storage_manager({"server_socket": served.socket})  # another LMCache process
        try:
            assert prefetch(b, keys, lay).hit_cells[0].count_leading_ones() == 4
            with b.read_prefetched_results(keys) as got:
                assert all(
                    bytes(memoryview(o.byte_array).cast("B")) == want[k] for k, o in zip(keys, got)
                )
            b.finish_read_prefetched(keys)
        finally:
            b.close()
    finally:
        served.stop()


# ------------------------------------------------------------------ legacy remote plugin

KV_SHAPE = (2, 2, 16, 4, 64)


def legacy_config(instance, save_chunk_meta=True, **kvtier):
    from lmcache.v1.config import LMCacheEngineConfig

    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=16, local_cpu=True, max_local_cpu_size=0.05, lmcache_instance_id=instance
    )
    cfg.remote_storage_plugins = ["kvtier"]
    cfg.extra_config = {
        "remote_storage_plugin.kvtier.module_path": "kvtier.lmcache",
        "remote_storage_plugin.kvtier.class_name": "KvtierConnectorAdapter",
        "remote_storage_plugin.kvtier.config": {"dram_capacity_bytes": 32 << 20, **kvtier},
        "save_chunk_meta": save_chunk_meta,
    }
    return cfg


def legacy_metadata():
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(
        model_name="m",
        world_size=1,
        local_world_size=1,
        worker_id=0,
        local_worker_id=0,
        kv_dtype=torch.bfloat16,
        kv_shape=KV_SHAPE,
        chunk_size=16,
    )


@pytest.mark.parametrize("save_chunk_meta", [True, False])
def test_legacy_plugin_put_drop_local_get_byte_exact(save_chunk_meta):
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.event_manager import EventManager
    from lmcache.v1.storage_backend.storage_manager import StorageManager

    from kvtier.lmcache import KvtierRemoteConnector

    mgr = StorageManager(
        legacy_config("kvtier-legacy", save_chunk_meta), legacy_metadata(), EventManager()
    )
    try:
        remote = mgr.storage_backends["RemoteBackend-kvtier"]
        conn = remote.connection._connector
        assert isinstance(conn, KvtierRemoteConnector)
        keys = [CacheEngineKey("m", 1, 0, i, torch.bfloat16) for i in range(6)]
        objs, want = [], {}
        for k in keys:
            o = mgr.allocate(torch.Size([2, 2, 16, 256]), torch.bfloat16)
            want[k] = fill(memoryview(o.byte_array), str(k.chunk_hash).encode())
            objs.append(o)
        mgr.batched_put(keys, objs)
        wait(lambda: all(remote.contains(k) for k in keys), "remote puts")
        assert conn._store.stats()["objects"] == (12 if save_chunk_meta else 6)
        local = mgr.storage_backends["LocalCPUBackend"]
        for k in keys:
            local.remove(k)
        assert not any(local.contains(k) for k in keys)
        for k in keys:
            got = mgr.get(k)
            assert got is not None and bytes(memoryview(got.byte_array).cast("B")) == want[k]
        assert mgr.get(CacheEngineKey("m", 1, 0, 999, torch.bfloat16)) is None
    finally:
        mgr.close()


def test_lmcache_engine_store_lookup_retrieve_from_kvtier():
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.gpu_connector.mock_gpu_connector import MockGPUConnector

    name = "kvtier-engine"
    eng = LMCacheEngineBuilder.get_or_create(
        name,
        legacy_config(name),
        legacy_metadata(),
        MockGPUConnector(KV_SHAPE),
        lambda t, r: None,
        lambda o, r: o,
    )
    try:
        eng.post_init()
        tokens = torch.arange(64)
        eng.store(tokens)
        mgr = eng.storage_manager
        remote = mgr.storage_backends["RemoteBackend-kvtier"]
        conn = remote.connection._connector
        wait(lambda: conn._store.stats()["objects"] >= 4, "4 chunks in kvtier")
        # clear() skips chunks still referenced (the remote put releases its reference after
        # kvtier has stored them): clear until none is left, so the retrieve below must come
        # from kvtier.
        local = mgr.storage_backends["LocalCPUBackend"]

        def local_emptied():
            local.clear()
            return len(local.hot_cache) == 0

        wait(local_emptied, "LMCache's local CPU copies cleared")
        hits_before = conn._store.stats()["hits"]
        assert eng.lookup(tokens) == 64
        ret = eng.retrieve(tokens)
        assert int(ret.sum()) == 64
        assert conn._store.stats()["hits"] > hits_before  # served by kvtier
        assert eng.lookup(torch.arange(1000, 1064)) == 0
    finally:
        LMCacheEngineBuilder.destroy(name)


def test_batch_queue_is_bounded_and_every_submit_completes_once():
    """kvtier's BatchQueue (both integrations run on it): beyond its capacity a batch fails at
    once with a named error instead of blocking the engine; close() fails what is queued; every
    submitted id completes exactly once."""
    from kvtier import _native

    store = _native.Store('{"dram_capacity_bytes": 268435456}')
    q = _native.BatchQueue(store, 1, 1)
    bufs = [bytearray(4 << 20) for _ in range(16)]
    ids = [q.submit_put([f"k{i}"], [bufs[i]]) for i in range(16)]
    assert len(set(ids)) == 16
    q.close()  # running batch finishes, queued ones fail
    assert q.closed
    late = q.submit_exists(["k0"])  # after close: completes at once, failed
    done = {}
    for fid, ok, err, bools in q.drain():
        assert fid not in done
        done[fid] = (ok, err)
    assert set(done) == set(ids) | {late}
    errors = [e for ok, e in done.values() if not ok]
    assert any("queue full" in e for e in errors), errors
    assert any("closed" in e for e in errors)
    # Nothing else failed: each batch ran, was refused as full, or was failed by close().
    assert all(ok or "queue full" in e or "closed" in e for ok, e in done.values())
    with pytest.raises(ValueError, match="threads"):
        _native.BatchQueue(store, 0)
    store.close()
