"""One SGLang "TP rank" process for test_server_mode.py: real SGLang host pools and a real
KvtierStore in server mode, driven over a multiprocessing pipe.

Commands are ``(name, kwargs)``; the reply is ``("ok", value)`` or ``("error", traceback)``.
"""

from __future__ import annotations

import os
import time
import traceback

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

DYNAMIC = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore"}

STATE: dict = {}


def setup(kind, tp_rank, tp_size, socket, allocator="shm", v1=True, **extra):
    import kvtier_dev.harness.flows as cf
    import kvtier_dev.harness.pools as sp
    from kvtier.sglang import KvtierStore

    ec = {**DYNAMIC, "server_socket": socket, **extra}
    if v1:
        ec["interface_v1"] = 1
    is_mla = kind in ("mla", "dsv4")
    cfg = sp.make_storage_config(tp_rank=tp_rank, tp_size=tp_size, is_mla=is_mla, extra_config=ec)
    if kind == "mha":
        target = sp.build_mha_host_pool(allocator_type=allocator)
    elif kind == "mla":
        target = sp.build_mla_host_pool(allocator_type=allocator)
    elif kind == "dsv4":
        target = sp.build_dsv4_pool_group("page_first")
    else:
        raise ValueError(kind)
    store = KvtierStore(cfg, {})
    cf.attach_backend(store, target if kind == "dsv4" else sp.kv_only_group(target))
    STATE.update(kind=kind, target=target, store=store, cfg=cfg, v1=v1)
    anchor = target.anchor if kind == "dsv4" else target
    STATE["anchor"] = anchor
    return {
        "pid": os.getpid(),
        "mode": store._store.mode,
        "zero_copy_regions": store._store.zero_copy_regions(),
        "writes_replicated": store._writes_replicated_kv,
    }


def v1_write(keys, seed):
    """Fill fresh pages, store them with batch_set_v1 (or legacy batch_set); their bytes."""
    import kvtier_dev.harness.pools as sp

    host, store = STATE["anchor"], STATE["store"]
    idx = sp.alloc_indices(host, len(keys))
    written = sp.fill_pages(host, idx, seed)
    if STATE["v1"]:
        ok = store.batch_set_v1(list(keys), idx)
    else:
        pages = [
            host.get_data_page(int(idx[i * host.page_size]), flat=True) for i in range(len(keys))
        ]
        ok = [store.batch_set(list(keys), pages)] * len(keys)
    sp.free_indices(host, idx)
    return list(ok), written


def v1_read(keys):
    import kvtier_dev.harness.pools as sp

    host, store = STATE["anchor"], STATE["store"]
    idx = sp.alloc_indices(host, len(keys))
    sp.zero_pages(host, idx)
    if STATE["v1"]:
        ok = store.batch_get_v1(list(keys), idx)
    else:
        ps = host.page_size
        targets = [host.get_dummy_flat_data_page() for _ in keys]
        got = store.batch_get(list(keys), targets)
        ok = []
        for i, t in enumerate(got):
            if t is not None:
                host.set_from_flat_data_page(int(idx[i * ps]), t)
            ok.append(t is not None)
    data = sp.read_pages(host, idx)
    sp.free_indices(host, idx)
    return list(ok), data


def v1_exists(keys):
    return STATE["store"].batch_exists(list(keys))


def v2_backup(keys, seed):
    """Back up one span through the real controller flow; {pool: {key: page bytes}}."""
    import kvtier_dev.harness.flows as cf
    import kvtier_dev.harness.pools as sp
    from sglang.srt.mem_cache.hicache_storage import PoolName

    stack, store = STATE["target"], STATE["store"]
    n = len(keys)
    kv_idx = sp.alloc_indices(stack.anchor, n)
    per_pool = {PoolName.KV: kv_idx}
    swa = stack.spec(PoolName.SWA)
    swa_idx = sp.alloc_indices(swa.host_pool, min(swa.window_pages, n))
    per_pool[PoolName.SWA] = swa_idx
    truth = {}
    for s in stack.specs:
        if s.is_anchor:
            continue
        on_swa = s.name == PoolName.SWA or s.indices_from_pool == PoolName.SWA
        idx = swa_idx if on_swa else kv_idx
        sp.fill_pages(s.host_pool, idx, seed)
        pages = sp.read_pages(s.host_pool, idx)
        truth[str(s.name)] = dict(zip(keys[-len(pages) :], pages))
    res = cf.backup_span(store, stack, keys, per_pool, prefix_keys=[], use_v1=True)
    sp.free_indices(stack.anchor, kv_idx)
    sp.free_indices(swa.host_pool, swa_idx)
    return res.completed_pages, {str(k): v for k, v in res.pool_hits.items()}, truth


def v2_prefetch(keys):
    """Query and load a span through the real controller flow; (hit, {pool: {key: bytes}})."""
    import kvtier_dev.harness.flows as cf
    import kvtier_dev.harness.pools as sp
    from sglang.srt.mem_cache.hicache_storage import PoolName

    stack, store = STATE["target"], STATE["store"]
    n = len(keys)
    kv_idx = sp.alloc_indices(stack.anchor, n)
    swa = stack.spec(PoolName.SWA)
    swa_idx = sp.alloc_indices(swa.host_pool, swa.window_pages)
    per_pool = {PoolName.KV: kv_idx, PoolName.SWA: swa_idx}
    for s in stack.specs:
        if s.is_anchor:
            continue
        on_swa = s.name == PoolName.SWA or s.indices_from_pool == PoolName.SWA
        sp.zero_pages(s.host_pool, swa_idx if on_swa else kv_idx)
    res = cf.prefetch_span(
        store, stack, keys, prefix_keys=[], use_v1=True, host_indices_per_pool=per_pool
    )
    got = {}
    for s in stack.specs:
        if s.is_anchor or res.hit_pages == 0:
            continue
        count = res.counts.get(s.name, 0)
        idx = res.host_indices[s.name][: count * s.page_size]
        pages = sp.read_pages(s.host_pool, idx)
        got[str(s.name)] = dict(zip(res.key_ranges[s.name][:count], pages))
    query = res.query
    sp.free_indices(stack.anchor, kv_idx)
    sp.free_indices(swa.host_pool, swa_idx)
    return res.hit_pages, query.kv_hit_pages, got


def raw_put_outside(size):
    """Ask the native store to put from a pointer outside every registered region."""
    import ctypes

    buf = ctypes.create_string_buffer(size)
    ok, errors = STATE["store"]._store.put_keys(["outside"], [ctypes.addressof(buf)], [size], None)
    return list(ok), list(errors)


def spin(keys, seed):
    """Write pages forever (until killed): the batch a SIGKILL interrupts."""
    import kvtier_dev.harness.pools as sp

    host, store = STATE["anchor"], STATE["store"]
    idx = sp.alloc_indices(host, len(keys))
    sp.fill_pages(host, idx, seed)
    round_ = 0
    while True:
        store.batch_set_v1([f"{k}-{round_}" for k in keys], idx)
        round_ += 1


def stats():
    return STATE["store"].get_stats().as_dict()


def close():
    STATE["store"].close()
    return True


def reset():
    """Close this rank's store (ending its server session) and forget its pools."""
    store = STATE.pop("store", None)
    if store is not None:
        store.close()
    STATE.clear()
    return True


def main(conn):
    while True:
        try:
            name, kwargs = conn.recv()
        except EOFError:
            return
        if name == "exit":
            conn.send(("ok", None))
            return
        try:
            fn = globals()[name]
            if name == "spin":
                conn.send(("ok", "spinning"))
            value = fn(**kwargs)
            conn.send(("ok", value))
        except Exception:
            conn.send(("error", traceback.format_exc()))
        time.sleep(0)
