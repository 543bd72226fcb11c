"""One SGLang host process for test_cluster.py: real SGLang host pools and a real KvtierStore
in cluster mode (``master_address`` in extra_config), driven over a multiprocessing pipe.

It is _server_worker's process with a few more commands: the store is set up by
``_server_worker.setup`` (with no ``server_socket``), and the commands here return hashes of
page bytes and how long each call took, so the test can compare bytes across processes and
measure time bounds.
"""

from __future__ import annotations

import hashlib
import time

import _server_worker as sw

STATE = sw.STATE


def _digest(pages):
    return [hashlib.sha256(p).hexdigest() for p in pages]


def warm():
    """Import SGLang and the harness (the slow part of a first setup); the seconds it took."""
    started = time.perf_counter()
    import kvtier_dev.harness.flows  # noqa: F401
    import kvtier_dev.harness.pools  # noqa: F401
    import kvtier.sglang  # noqa: F401

    return time.perf_counter() - started


def v2_backup_hashed(keys, seed):
    """``_server_worker.v2_backup`` (real controller flow: batch_set_v2 for the side pools),
    with every page's bytes replaced by their hash; plus the elapsed seconds."""
    started = time.perf_counter()
    completed, pool_hits, truth = sw.v2_backup(keys, seed)
    elapsed = time.perf_counter() - started
    hashed = {pool: dict(zip(pages, _digest(pages.values()))) for pool, pages in truth.items()}
    return completed, pool_hits, hashed, elapsed


def v2_prefetch_hashed(keys):
    """``_server_worker.v2_prefetch`` (batch_exists_v2 then batch_get_v2), page hashes."""
    started = time.perf_counter()
    hit, kv_hit, got = sw.v2_prefetch(keys)
    elapsed = time.perf_counter() - started
    hashed = {pool: dict(zip(pages, _digest(pages.values()))) for pool, pages in got.items()}
    return hit, kv_hit, hashed, elapsed


def exists_v2(keys):
    """The whole answer of one batch_exists_v2 over the DSV4 group, as the prefetch query
    builds it; and the elapsed seconds."""
    import kvtier_dev.harness.flows as cf

    started = time.perf_counter()
    res = cf.query_span(STATE["store"], list(keys), STATE["target"])
    elapsed = time.perf_counter() - started
    pools = {str(getattr(k, "value", k)): int(v) for k, v in res.extra_pool_hit_pages.items()}
    return int(res.kv_hit_pages), pools, elapsed


def v1_write_hashed(keys, seed):
    started = time.perf_counter()
    ok, written = sw.v1_write(keys, seed)
    return ok, _digest(written), time.perf_counter() - started


def v1_read_hashed(keys):
    started = time.perf_counter()
    ok, data = sw.v1_read(keys)
    return ok, _digest(data), time.perf_counter() - started


def v1_exists_timed(keys):
    started = time.perf_counter()
    hit = sw.v1_exists(keys)
    return hit, time.perf_counter() - started


def set_env(env):
    """Set (a value) or unset (None) environment variables of this process: UCX reads
    ``UCX_TLS`` / ``UCX_NET_DEVICES`` when a client creates its UCX context, at setup."""
    import os

    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    return True


def stats_json():
    """The store's whole stats document (with ``peer_transports``), parsed."""
    import json

    return json.loads(STATE["store"]._store.stats_json())


def ucx_regions():
    """(regions in the store's registry, ``ucx_registered_regions``,
    ``ucx_registration_failures``, ``ucx_registered_transfers``) of the stats."""
    st = stats_json()
    return (
        len(STATE["store"]._store.regions()),
        st.get("ucx_registered_regions"),
        st.get("ucx_registration_failures"),
        st.get("ucx_registered_transfers"),
    )


def register_scratch(label, nbytes=1 << 20):
    """Register one more host buffer (kept alive in STATE) under ``label``."""
    import ctypes

    buf = ctypes.create_string_buffer(nbytes)
    STATE.setdefault("scratch", []).append(buf)
    STATE["store"]._store.register_region(ctypes.addressof(buf), nbytes, label)
    return True


def clear():
    """The store's ``clear()`` (SGLang's HiCacheStorage.clear; in cluster mode a Forget of
    every key through the master)."""
    return STATE["store"].clear()


COMMANDS = {
    f.__name__: f
    for f in (
        warm,
        v2_backup_hashed,
        v2_prefetch_hashed,
        exists_v2,
        v1_write_hashed,
        v1_read_hashed,
        v1_exists_timed,
        set_env,
        stats_json,
        ucx_regions,
        register_scratch,
        clear,
    )
}


def main(conn):
    # _server_worker's command loop dispatches through its module globals: add ours there.
    vars(sw).update(COMMANDS)
    sw.main(conn)
