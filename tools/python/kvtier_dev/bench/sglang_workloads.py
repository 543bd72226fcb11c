"""SGLang HiCache workloads, run through kvtier and through SGLang's ``HiCacheFile``.

Everything that touches SGLang is SGLang's own code: host pools from
``kvtier_dev.harness.pools`` (real ``MHATokenToKVPoolHost`` / DeepSeek-V4 ``HostPoolGroup``),
backends made by the real ``StorageBackendFactory`` and attached in the controller's order,
and the controller's own methods.

Per workload:

* **raw batch calls**, 128 pages a call (``STORAGE_BATCH_SIZE``):

  - kvtier, MHA: ``batch_set_v1`` / ``batch_get_v1`` (``"interface_v1": 1``), i.e. what
    ``_page_set_zero_copy`` / ``_page_get_zero_copy`` call;
  - HiCacheFile, MHA: it has no v1, and SGLang's controller only uses v1 for a ``dynamic``
    backend, so it runs the controller's real ``_generic_page_set`` (``get_data_page`` per page
    + ``batch_set``) and ``_generic_page_get`` (``get_dummy_flat_data_page`` per page +
    ``batch_get`` + ``set_from_flat_data_page``): exactly what SGLang does with HiCacheFile;
  - both, DeepSeek-V4: one ``batch_set_v2`` / ``batch_get_v2`` with every side pool;
  - both: ``batch_exists_v2`` over 128 pages with the transfers a prefetch sends (4 pools and
    all 6 side pools).

  A set repetition uses fresh keys in an emptied store (``clear()`` outside the timed region),
  so it measures real copies (kvtier puts are put-if-absent); ``set_repeat`` separately times a
  set of keys that are all present (kvtier: dedup skips, HiCacheFile: ``exists`` skips).
  Gets rotate over several 128-page windows of a pool of >= ``region_bytes`` so that small
  objects are not served from the CPU cache. HiCacheFile's gets come from the page cache.

* **controller flows**: ``backup_span`` / ``query_span`` / ``prefetch_span`` (SGLang's
  ``_page_backup``, ``_storage_hit_query`` + ``_sync_prefetch_hit_query``, ``_page_transfer``
  on a minimal real ``HybridCacheController``), kvtier with v1, HiCacheFile with the legacy
  path, as SGLang would drive each.

Correctness: once per workload and backend, outside the timed region, the pages of one window
are zeroed, read back through the measured call, and compared byte for byte with a snapshot
(``verified``). Every timed call's result is checked too (``failures``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import gc
import logging
import math
import os
import shutil
import tempfile
import time
import zlib
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageExtraInfo,
    PoolName,
    PoolTransfer,
)

import kvtier_dev.harness.flows as cf  # noqa: E402
import kvtier_dev.harness.pools as sp  # noqa: E402
from kvtier_dev.bench.timing import Runner, Samples, interleave  # noqa: E402

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

KVTIER = "kvtier"
FILE = "hicache_file"
MEMCPY = "memcpy_same_size"


# --------------------------------------------------------------------------
# Scale of a run
# --------------------------------------------------------------------------


@dataclass
class Scale:
    name: str
    batch_pages: int = 128
    # Host-pool footprint a raw workload rotates its 128-page windows over.
    region_bytes: int = 256 * MiB
    max_windows: int = 32
    mha_components: Sequence[int] = (32 * KiB, 64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB)
    # Component sizes that also run the controller flows.
    flow_components: Sequence[int] = (32 * KiB, 256 * KiB)
    flow_span_pages: int = 256
    dsv4_device_pages: int = 256  # host pages = 2x (hicache_ratio 2)
    dsv4_flow_span_pages: int = 256
    # (min_reps, max_reps, budget seconds) per backend and measurement
    io_reps: tuple = (8, 60, 3.0)
    io_reps_file: tuple = (4, 24, 3.0)
    exists_reps: tuple = (500, 6000, 1.5)
    exists_reps_file: tuple = (40, 500, 1.5)
    flow_reps: tuple = (6, 50, 2.0)
    flow_reps_file: tuple = (4, 24, 2.5)
    rounds: int = 4
    memcpy_total: int = 1 * GiB
    memcpy_passes: int = 7
    sync_before_file_set: bool = True


FULL = Scale("full")
QUICK = Scale(
    "quick",
    region_bytes=96 * MiB,
    max_windows=8,
    mha_components=(32 * KiB, 256 * KiB, 1 * MiB),
    flow_components=(32 * KiB, 256 * KiB),
    flow_span_pages=256,
    dsv4_device_pages=64,
    dsv4_flow_span_pages=128,
    io_reps=(3, 12, 0.8),
    io_reps_file=(2, 6, 1.0),
    exists_reps=(200, 1500, 0.5),
    exists_reps_file=(20, 100, 0.5),
    flow_reps=(3, 10, 0.6),
    flow_reps_file=(2, 6, 0.8),
    rounds=2,
    memcpy_total=512 * MiB,
    memcpy_passes=5,
)
# For the smoke test: seconds, not minutes; same structure.
TINY = Scale(
    "tiny",
    batch_pages=8,
    region_bytes=4 * MiB,
    max_windows=2,
    mha_components=(32 * KiB, 256 * KiB),
    flow_components=(32 * KiB,),
    flow_span_pages=16,
    dsv4_device_pages=8,
    dsv4_flow_span_pages=8,
    io_reps=(2, 3, 0.2),
    io_reps_file=(2, 3, 0.2),
    exists_reps=(5, 20, 0.1),
    exists_reps_file=(3, 10, 0.1),
    flow_reps=(2, 3, 0.2),
    flow_reps_file=(2, 3, 0.2),
    rounds=1,
    memcpy_total=16 * MiB,
    memcpy_passes=2,
    sync_before_file_set=False,
)
SCALES = {s.name: s for s in (FULL, QUICK, TINY)}


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------


def quiet_logs() -> None:
    """HiCacheFile logs every clear and miss; kvtier logs its config on open."""
    for name in ("sglang", "kvtier"):
        logging.getLogger(name).setLevel(logging.ERROR)


def fresh_keys(n: int) -> List[str]:
    """SGLang page hashes are 64 hex digits (sha256)."""
    return [os.urandom(32).hex() for _ in range(n)]


def physical_buffers(pool) -> List[torch.Tensor]:
    found = []
    getter = getattr(pool, "get_hybrid_pool_buffer", None)
    if getter is not None:
        try:
            got = getter()
        except Exception:
            got = None
        if got is not None:
            found.extend(got if isinstance(got, (list, tuple)) else [got])
    kv = getattr(pool, "kv_buffer", None)
    if kv is not None:
        found.extend(kv if isinstance(kv, (list, tuple)) else [kv])
    out, seen = [], set()
    for t in found:
        if isinstance(t, torch.Tensor) and t.numel():
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            if key not in seen:
                seen.add(key)
                out.append(t)
    return out


_PERIOD = 16 * MiB + 4099  # odd period: no two pages of a pool hold the same bytes


def fill_random(pool, seed: int) -> int:
    """Fill (and so pre-fault) every physical buffer of a host pool with pseudo-random bytes."""
    rng = np.random.default_rng(seed)
    chunk = rng.integers(0, 256, size=_PERIOD, dtype=np.uint8)
    total = 0
    for t in physical_buffers(pool):
        storage = t.untyped_storage()
        n = storage.nbytes()
        buf = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(storage.data_ptr()))
        for off in range(0, n, _PERIOD):
            k = min(_PERIOD, n - off)
            buf[off : off + k] = chunk[:k]
        chunk = np.roll(chunk, 7919)
        total += n
    return total


def component_views(pool, host_indices: torch.Tensor) -> List[np.ndarray]:
    """Writable numpy views of every (pointer, size) component of the pages."""
    meta = pool.get_page_buffer_meta(host_indices)
    if meta is None:
        return []
    ptrs, sizes = meta
    if isinstance(sizes, int):
        sizes = [sizes] * len(ptrs)
    return [
        np.ctypeslib.as_array((ctypes.c_uint8 * int(s)).from_address(int(p)))
        for p, s in zip(ptrs, sizes)
    ]


class Snapshot:
    """Bytes of some pages of some pools, to zero them and check a read restored them."""

    def __init__(self, pools_and_indices: Sequence[tuple]):
        self.items = []
        for pool, idx in pools_and_indices:
            views = component_views(pool, idx)
            self.items.append((views, [v.copy() for v in views]))
        if not any(np.any(c) for _, copies in self.items for c in copies):
            raise AssertionError("snapshot is all zeros: the pool was not filled")

    def zero(self) -> None:
        for views, _ in self.items:
            for v in views:
                v.fill(0)

    def matches(self) -> bool:
        return all(
            np.array_equal(v, c) for views, copies in self.items for v, c in zip(views, copies)
        )

    def nbytes(self) -> int:
        return sum(c.nbytes for _, copies in self.items for c in copies)


def _verify(snapshot: Snapshot, read: Callable[[], bool]) -> bool:
    snapshot.zero()
    ok = bool(read())
    return ok and snapshot.matches()


KVTIER_DYNAMIC = {
    "backend_name": "kvtier",
    "module_path": "kvtier.sglang",
    "class_name": "KvtierStore",
    "interface_v1": 1,
    "hicache_storage_pass_prefix_keys": True,
}


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass
class Backends:
    kv: Any
    file: Any
    kv_cfg: Any
    file_cfg: Any
    file_dir: str
    capacity: int

    def close(self) -> None:
        try:
            self.kv.close()
        finally:
            try:
                self.file.clear()
            except Exception:
                pass
            shutil.rmtree(self.file_dir, ignore_errors=True)


def open_backends(
    group_or_pool, *, is_mla: bool, capacity: int, storage_root: Optional[str]
) -> Backends:
    """kvtier through ``--hicache-storage-backend dynamic`` and HiCacheFile through ``file``,
    both made by SGLang's StorageBackendFactory and attached in the controller's order."""
    os.environ.pop("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR", None)
    capacity = _round_up(int(capacity), 64 * MiB)
    kv_cfg = sp.make_storage_config(
        is_mla=is_mla, extra_config=dict(KVTIER_DYNAMIC, dram_capacity_bytes=capacity)
    )
    kv = cf.create_backend("dynamic", kv_cfg, group_or_pool)
    cf.attach_backend(kv, group_or_pool)
    file_dir = tempfile.mkdtemp(prefix="kvtier-bench-hicachefile-", dir=storage_root)
    file_cfg = sp.make_storage_config(is_mla=is_mla, extra_config={"file_storage_path": file_dir})
    fb = cf.create_backend("file", file_cfg, group_or_pool)
    cf.attach_backend(fb, group_or_pool)
    return Backends(kv, fb, kv_cfg, file_cfg, file_dir, capacity)


def _extra(prefix: Optional[List[str]] = None) -> HiCacheStorageExtraInfo:
    return HiCacheStorageExtraInfo(prefix_keys=list(prefix or []))


def _all_true_v2(result, transfers) -> bool:
    if not isinstance(result, dict) or len(result) != len(transfers):
        return False
    return all(
        len(result.get(t.name, [])) == len(t.keys or []) and all(result[t.name]) for t in transfers
    )


def _file_set_setup(backend, scale: Scale):
    backend.clear()
    if scale.sync_before_file_set:
        os.sync()  # start every rep from clean page cache (favours HiCacheFile)


def _op_stub():
    # What _generic_page_get reads from a PrefetchOperation.
    return SimpleNamespace(is_terminated=lambda: False, request_id="kvtier-bench")


def _runner(setup, timed, samples, reps) -> Runner:
    lo, hi, budget = reps
    return Runner(
        setup=setup, timed=timed, samples=samples, min_reps=lo, max_reps=hi, budget_s=budget
    )


def _kvtier_vs_file(runner, kvtier_reps, file_reps, rounds):
    """Interleave kvtier's and HiCacheFile's runs of one operation and summarize both."""
    return _summaries(
        interleave({KVTIER: runner(KVTIER, kvtier_reps), FILE: runner(FILE, file_reps)}, rounds)
    )


def _verified_prefetch_flow(out, snap, prefetch, n_spans, samples, scale, label=""):
    """Check one prefetch per backend byte for byte (untimed), then time the prefetch flow."""
    for which in (KVTIER, FILE):
        out["verified"][which]["prefetch"] = _verify(snap, lambda: prefetch(which, 0))
    if not snap.matches():
        raise AssertionError(f"{label}a verified prefetch left wrong bytes")

    def runner(which, reps):
        return _runner(lambda rep: rep % n_spans, lambda s: prefetch(which, s), samples, reps)

    return _kvtier_vs_file(runner, scale.flow_reps, scale.flow_reps_file, scale.rounds)


def _memcpy_runner(obj_bytes: int, objects: int, scale: Scale, reps) -> Runner:
    """The same number of same-size objects gathered from a cold region, interleaved with the
    backends' repetitions (a same-time reference on a noisy machine)."""
    objects = max(16, min(objects, (128 * MiB) // obj_bytes))
    n_src = max(2 * objects, scale.region_bytes // obj_bytes)
    src = np.empty((n_src, obj_bytes), dtype=np.uint8)
    src.fill(5)
    dst = np.empty((objects, obj_bytes), dtype=np.uint8)
    dst.fill(6)
    rng = np.random.default_rng(obj_bytes)
    samples = Samples(bytes_per_rep=objects * obj_bytes, pages_per_rep=0)

    def setup(rep):
        return rng.choice(n_src, size=objects, replace=False)

    def timed(pick):
        np.take(src, pick, axis=0, out=dst, mode="clip")
        return True

    return _runner(setup, timed, samples, reps)


def _summaries(samples: Dict[str, Samples]) -> Dict[str, Dict[str, Any]]:
    return {name: s.summary() for name, s in samples.items()}


# --------------------------------------------------------------------------
# MHA page_first
# --------------------------------------------------------------------------


def mha_geometry(component_bytes: int) -> dict:
    """bf16, head_dim 64: 16-token pages x 2 heads below 256 KiB, 64-token pages x 4 heads
    from 256 KiB; the layer count makes one K (or V) component exactly ``component_bytes``."""
    if component_bytes < 256 * KiB:
        page_size, head_num = 16, 2
    else:
        page_size, head_num = 64, 4
    per_layer = page_size * head_num * 64 * 2
    if component_bytes % per_layer:
        raise ValueError(f"component size {component_bytes} is not a multiple of {per_layer}")
    return dict(
        page_size=page_size, layer_num=component_bytes // per_layer, head_num=head_num, head_dim=64
    )


def _fmt_size(n: int) -> str:
    if n >= MiB and n % MiB == 0:
        return f"{n // MiB}MiB"
    if n >= KiB and n % KiB == 0:
        return f"{n // KiB}KiB"
    return f"{n}B"


def mha_workload(
    scale: Scale,
    component_bytes: int,
    *,
    storage_root: Optional[str] = None,
    flows: Optional[bool] = None,
) -> dict:
    geom = mha_geometry(component_bytes)
    ps = geom["page_size"]
    batch = scale.batch_pages
    page_bytes = 2 * component_bytes
    windows = max(1, min(scale.max_windows, math.ceil(scale.region_bytes / (batch * page_bytes))))
    if flows is None:
        flows = component_bytes in tuple(scale.flow_components)
    span = min(scale.flow_span_pages, windows * batch) if flows else 0
    if flows:
        windows = max(windows, math.ceil(span / batch))
    pages = windows * batch
    pool = sp.build_mha_host_pool("page_first", size_pages=pages, device_pages=4, **geom)
    assert sp.page_nbytes(pool) == page_bytes
    fill_random(pool, seed=component_bytes)
    all_idx = sp.alloc_indices(pool, pages)
    win_idx = [all_idx[w * batch * ps : (w + 1) * batch * ps] for w in range(windows)]

    name = f"mha-{_fmt_size(component_bytes)}"
    out: Dict[str, Any] = dict(
        workload=name,
        kind="mha",
        layout="page_first",
        model=dict(geom, dtype="bfloat16"),
        object_bytes=component_bytes,
        objects_per_page=2,
        page_bytes=page_bytes,
        batch_pages=batch,
        pool_pages=pages,
        windows=windows,
        paths={
            KVTIER: "batch_set_v1 / batch_get_v1 (interface_v1=1, zero copy)",
            FILE: "controller _generic_page_set / _generic_page_get -> HiCacheFile.batch_set / batch_get "
            "(get_data_page / set_from_flat_data_page per page; HiCacheFile has no v1)",
        },
        ops={},
        verified={KVTIER: {}, FILE: {}},
    )
    capacity = pages * page_bytes * 1.1 + 2 * batch * page_bytes + 64 * MiB
    be = open_backends(pool, is_mla=False, capacity=capacity, storage_root=storage_root)
    out["kvtier_capacity_bytes"] = be.capacity
    try:
        cc_file = cf.make_controller(be.file, pool, use_v1=False, storage_config=be.file_cfg)
        extra = _extra()
        batch_bytes = batch * page_bytes

        # ---- set: fresh keys into an emptied store
        def kv_set_setup(rep):
            be.kv.clear()
            return fresh_keys(batch), win_idx[rep % windows]

        def file_set_setup(rep):
            _file_set_setup(be.file, scale)
            return fresh_keys(batch), win_idx[rep % windows]

        runners = {
            KVTIER: _runner(
                kv_set_setup,
                lambda a: all(be.kv.batch_set_v1(a[0], a[1], extra)),
                Samples(batch_bytes, batch),
                scale.io_reps,
            ),
            FILE: _runner(
                file_set_setup,
                lambda a: bool(cc_file._generic_page_set(a[0], a[1], extra)),
                Samples(batch_bytes, batch),
                scale.io_reps_file,
            ),
            MEMCPY: _memcpy_runner(component_bytes, 2 * batch, scale, scale.io_reps),
        }
        out["ops"]["set"] = _summaries(interleave(runners, scale.rounds))

        # ---- populate every window once (untimed), then verify, then time gets
        be.kv.clear()
        be.file.clear()
        keys = [fresh_keys(batch) for _ in range(windows)]
        for w in range(windows):
            assert all(be.kv.batch_set_v1(keys[w], win_idx[w], extra)), "kvtier populate failed"
            assert cc_file._generic_page_set(keys[w], win_idx[w], extra), (
                "HiCacheFile populate failed"
            )
        before = dict(be.kv.get_stats().store)

        # ---- set of keys that are all present (dedup skip)
        runners = {
            KVTIER: _runner(
                lambda rep: (keys[rep % windows], win_idx[rep % windows]),
                lambda a: all(be.kv.batch_set_v1(a[0], a[1], extra)),
                Samples(batch_bytes, batch),
                scale.io_reps,
            ),
            FILE: _runner(
                lambda rep: (keys[rep % windows], win_idx[rep % windows]),
                lambda a: bool(cc_file._generic_page_set(a[0], a[1], extra)),
                Samples(batch_bytes, batch),
                scale.io_reps_file,
            ),
        }
        out["ops"]["set_repeat"] = _summaries(interleave(runners, 1))
        after = dict(be.kv.get_stats().store)
        reps = out["ops"]["set_repeat"][KVTIER]["reps"] + 1  # + warm-up
        asked = reps * batch * 2
        out["ops"]["set_repeat"][KVTIER]["dedup_skip_rate"] = (
            after["dedup_skips"] - before["dedup_skips"]
        ) / asked
        out["ops"]["set_repeat"][KVTIER]["copied_bytes"] = after["bytes_in"] - before["bytes_in"]

        snap = Snapshot([(pool, win_idx[0])])
        out["verified"][KVTIER]["get"] = _verify(
            snap, lambda: all(be.kv.batch_get_v1(keys[0], win_idx[0], extra))
        )
        out["verified"][FILE]["get"] = _verify(
            snap, lambda: cc_file._generic_page_get(_op_stub(), keys[0], win_idx[0], extra) == batch
        )
        out["verified"]["bytes"] = snap.nbytes()
        if not snap.matches():  # leave the pool as it was for the timed gets
            raise AssertionError(f"{name}: a verified read left wrong bytes")

        runners = {
            KVTIER: _runner(
                lambda rep: (keys[rep % windows], win_idx[rep % windows]),
                lambda a: all(be.kv.batch_get_v1(a[0], a[1], extra)),
                Samples(batch_bytes, batch),
                scale.io_reps,
            ),
            FILE: _runner(
                lambda rep: (keys[rep % windows], win_idx[rep % windows]),
                lambda a: cc_file._generic_page_get(_op_stub(), a[0], a[1], extra) == batch,
                Samples(batch_bytes, batch),
                scale.io_reps_file,
            ),
            MEMCPY: _memcpy_runner(component_bytes, 2 * batch, scale, scale.io_reps),
        }
        out["ops"]["get"] = _summaries(interleave(runners, scale.rounds))

        if flows:
            out["flow_span_pages"] = span
            out["ops"].update(_mha_flows(scale, pool, be, all_idx, span, page_bytes, out))
        out["kvtier_stats"] = dict(be.kv.get_stats().store)
    finally:
        be.close()
        del pool
        gc.collect()
    return out


def _mha_flows(
    scale: Scale, pool, be: Backends, all_idx, span: int, page_bytes: int, out: dict
) -> dict:
    ps = pool.page_size
    n_spans = max(1, all_idx.numel() // (span * ps))
    span_idx = [all_idx[s * span * ps : (s + 1) * span * ps] for s in range(n_spans)]
    span_bytes = span * page_bytes
    prefix = fresh_keys(4)  # a chain above the span: prefix_keys are passed
    use_v1 = {KVTIER: True, FILE: False}
    backend = {KVTIER: be.kv, FILE: be.file}
    cfgs = {KVTIER: be.kv_cfg, FILE: be.file_cfg}
    ops = {}

    def backup_runner(which, reps):
        def setup(rep):
            if which == FILE:
                _file_set_setup(be.file, scale)
            else:
                be.kv.clear()
            return fresh_keys(span), span_idx[rep % n_spans]

        def timed(a):
            res = cf.backup_span(
                backend[which],
                pool,
                a[0],
                {PoolName.KV: a[1]},
                prefix_keys=prefix,
                use_v1=use_v1[which],
                storage_config=cfgs[which],
            )
            return res.completed_pages == span

        return _runner(setup, timed, Samples(span_bytes, span), reps)

    ops["flow_backup"] = _kvtier_vs_file(
        backup_runner, scale.flow_reps, scale.flow_reps_file, scale.rounds
    )

    # Populate every span once on both backends through the real backup flow.
    be.kv.clear()
    be.file.clear()
    keys = [fresh_keys(span) for _ in range(n_spans)]
    for s in range(n_spans):
        for which in (KVTIER, FILE):
            res = cf.backup_span(
                backend[which],
                pool,
                keys[s],
                {PoolName.KV: span_idx[s]},
                prefix_keys=prefix,
                use_v1=use_v1[which],
                storage_config=cfgs[which],
            )
            assert res.completed_pages == span, f"{which} populate backup failed"

    def query_runner(which, reps):
        return _runner(
            lambda rep: keys[rep % n_spans],
            lambda k: (
                cf.query_span(backend[which], k, pool, prefix_keys=prefix).kv_hit_pages == span
            ),
            Samples(0, span),
            reps,
        )

    ops["flow_query"] = _kvtier_vs_file(
        query_runner, scale.exists_reps_file, scale.exists_reps_file, scale.rounds
    )

    def prefetch(which, s):
        pre = cf.prefetch_span(
            backend[which],
            pool,
            keys[s],
            prefix_keys=prefix,
            use_v1=use_v1[which],
            host_indices_per_pool={PoolName.KV: span_idx[s]},
            storage_config=cfgs[which],
        )
        return pre.hit_pages == span and pre.counts[PoolName.KV] == span

    snap = Snapshot([(pool, span_idx[0])])
    ops["flow_prefetch"] = _verified_prefetch_flow(
        out, snap, prefetch, n_spans, Samples(span_bytes, span), scale, ""
    )
    return ops


# --------------------------------------------------------------------------
# DeepSeek-V4 HostPoolGroup
# --------------------------------------------------------------------------


def dsv4_workload(scale: Scale, *, storage_root: Optional[str] = None) -> dict:
    d = scale.dsv4_device_pages
    stack = sp.build_dsv4_pool_group("page_first", device_full_pages=d, device_swa_pages=d)
    side = stack.side_specs
    ps = stack.page_size
    batch = scale.batch_pages
    pool_pages = min(s.host_pool.size // s.page_size for s in side)
    windows = max(1, min(scale.max_windows, pool_pages // batch))
    if pool_pages < batch:
        raise ValueError(f"DSV4 pools have {pool_pages} pages; need >= {batch}")
    for s in side:
        fill_random(s.host_pool, seed=zlib.crc32(str(s.name).encode()))
    win_idx = [
        torch.arange(w * batch * ps, (w + 1) * batch * ps, dtype=torch.int64)
        for w in range(windows)
    ]
    page_bytes = {str(s.name.value): s.page_bytes for s in side}
    batch_bytes = batch * sum(page_bytes.values())

    out: Dict[str, Any] = dict(
        workload="dsv4",
        kind="dsv4",
        layout="page_first",
        model=dict(
            page_size=ps,
            compression_ratios=[0, 4, 128, 4],
            dtype="float8_e4m3fn",
            device_full_pages=d,
            anchor=type(stack.anchor).__name__,
        ),
        pools={
            str(s.name.value): dict(
                cls=type(s.host_pool).__name__,
                hit_policy=s.hit_policy.value,
                indices_from=None
                if s.indices_from_pool is None
                else str(s.indices_from_pool.value),
                page_bytes=s.page_bytes,
                host_pages=s.host_pool.size // s.page_size,
            )
            for s in side
        },
        object_bytes=sorted(page_bytes.values()),
        page_bytes=sum(page_bytes.values()),
        batch_pages=batch,
        pool_pages=pool_pages,
        windows=windows,
        paths={
            KVTIER: "batch_set_v2 / batch_get_v2 / batch_exists_v2 (one call, every side pool)",
            FILE: "HiCacheFile.batch_set_v2 / batch_get_v2 / batch_exists_v2 (same transfers)",
        },
        ops={},
        verified={KVTIER: {}, FILE: {}},
    )
    capacity = windows * batch_bytes * 1.35 + 2 * batch_bytes + 64 * MiB
    be = open_backends(stack, is_mla=True, capacity=capacity, storage_root=storage_root)
    out["kvtier_capacity_bytes"] = be.capacity
    extra = _extra()

    def transfers(keys, w):
        return [
            PoolTransfer(name=s.name, keys=keys, host_indices=win_idx[w], hit_policy=s.hit_policy)
            for s in side
        ]

    try:

        def set_setup(which):
            def setup(rep):
                if which == FILE:
                    _file_set_setup(be.file, scale)
                else:
                    be.kv.clear()
                return transfers(fresh_keys(batch), rep % windows)

            return setup

        runners = {
            KVTIER: _runner(
                set_setup(KVTIER),
                lambda t: _all_true_v2(be.kv.batch_set_v2(t, extra), t),
                Samples(batch_bytes, batch),
                scale.io_reps,
            ),
            FILE: _runner(
                set_setup(FILE),
                lambda t: _all_true_v2(be.file.batch_set_v2(t, extra), t),
                Samples(batch_bytes, batch),
                scale.io_reps_file,
            ),
        }
        out["ops"]["set"] = _summaries(interleave(runners, scale.rounds))

        be.kv.clear()
        be.file.clear()
        cc_file = cf.make_controller(be.file, stack, use_v1=False, storage_config=be.file_cfg)
        keys = [fresh_keys(batch) for _ in range(windows)]
        for w in range(windows):
            t = transfers(keys[w], w)
            assert _all_true_v2(be.kv.batch_set_v2(t, extra), t), "kvtier populate failed"
            assert _all_true_v2(be.file.batch_set_v2(t, extra), t), "HiCacheFile populate failed"
            # The KV anchor pages too, as the controller's KV loop writes them (logical anchor:
            # a no-op for kvtier, 0-byte files for HiCacheFile), so that existence queries hit.
            assert all(be.kv.batch_set_v1(keys[w], win_idx[w], extra)), (
                "kvtier anchor populate failed"
            )
            assert cc_file._generic_page_set(keys[w], win_idx[w], extra), (
                "HiCacheFile anchor populate failed"
            )

        runners = {
            KVTIER: _runner(
                lambda rep: transfers(keys[rep % windows], rep % windows),
                lambda t: _all_true_v2(be.kv.batch_set_v2(t, extra), t),
                Samples(batch_bytes, batch),
                scale.io_reps,
            ),
            FILE: _runner(
                lambda rep: transfers(keys[rep % windows], rep % windows),
                lambda t: _all_true_v2(be.file.batch_set_v2(t, extra), t),
                Samples(batch_bytes, batch),
                scale.io_reps_file,
            ),
        }
        before = dict(be.kv.get_stats().store)
        out["ops"]["set_repeat"] = _summaries(interleave(runners, 1))
        after = dict(be.kv.get_stats().store)
        asked = (out["ops"]["set_repeat"][KVTIER]["reps"] + 1) * batch * len(side)
        out["ops"]["set_repeat"][KVTIER]["dedup_skip_rate"] = (
            after["dedup_skips"] - before["dedup_skips"]
        ) / asked
        out["ops"]["set_repeat"][KVTIER]["copied_bytes"] = after["bytes_in"] - before["bytes_in"]

        snap = Snapshot([(s.host_pool, win_idx[0]) for s in side])
        for which, backend in ((KVTIER, be.kv), (FILE, be.file)):
            t = transfers(keys[0], 0)
            out["verified"][which]["get"] = _verify(
                snap, lambda: _all_true_v2(backend.batch_get_v2(t, extra), t)
            )
        out["verified"]["bytes"] = snap.nbytes()
        if not snap.matches():
            raise AssertionError("dsv4: a verified read left wrong bytes")

        runners = {
            KVTIER: _runner(
                lambda rep: transfers(keys[rep % windows], rep % windows),
                lambda t: _all_true_v2(be.kv.batch_get_v2(t, extra), t),
                Samples(batch_bytes, batch),
                scale.io_reps,
            ),
            FILE: _runner(
                lambda rep: transfers(keys[rep % windows], rep % windows),
                lambda t: _all_true_v2(be.file.batch_get_v2(t, extra), t),
                Samples(batch_bytes, batch),
                scale.io_reps_file,
            ),
        }
        out["ops"]["get"] = _summaries(interleave(runners, scale.rounds))

        # ---- batch_exists_v2: the transfers a prefetch sends, 128 pages, every page present
        four = [
            s
            for s in stack.specs
            if s.is_anchor
            or s.name
            in (
                PoolName.SWA,
                PoolName.DEEPSEEK_V4_C4,
                PoolName.DEEPSEEK_V4_C4_INDEXER,
                PoolName.DEEPSEEK_V4_C128,
            )
        ]
        for label, specs in (
            ("exists_v2_4pools", four),
            ("exists_v2_all_pools", list(stack.specs)),
        ):
            q = cf.build_prefetch_transfers(batch, specs)
            answers = {
                which: b.batch_exists_v2(keys[0], q, extra)
                for which, b in ((KVTIER, be.kv), (FILE, be.file))
            }
            agree = answers[KVTIER].kv_hit_pages == answers[FILE].kv_hit_pages == batch and list(
                answers[KVTIER].restorable_prefix_pages
            ) == list(answers[FILE].restorable_prefix_pages)
            out["verified"][KVTIER][label] = bool(agree)
            runners = {
                which: _runner(
                    lambda rep: keys[rep % windows],
                    (lambda b: lambda k: b.batch_exists_v2(k, q, extra).kv_hit_pages == batch)(b),
                    Samples(0, batch),
                    reps,
                )
                for which, b, reps in (
                    (KVTIER, be.kv, scale.exists_reps),
                    (FILE, be.file, scale.exists_reps_file),
                )
            }
            out["ops"][label] = _summaries(interleave(runners, scale.rounds))
            out["ops"][label]["pools"] = len(q)

        out["ops"].update(_dsv4_flows(scale, stack, be, out))
        out["kvtier_stats"] = dict(be.kv.get_stats().store)
    finally:
        be.close()
        del stack
        gc.collect()
    return out


def _dsv4_flows(scale: Scale, stack, be: Backends, out: dict) -> dict:
    ps = stack.page_size
    span = min(scale.dsv4_flow_span_pages, stack.full_host_pages)
    swa = stack.spec(PoolName.SWA)
    window = swa.window_pages or 1
    n_spans = max(1, min(stack.full_host_pages // span, stack.swa_host_pages // window))
    kv_idx = [
        torch.arange(s * span * ps, (s + 1) * span * ps, dtype=torch.int64) for s in range(n_spans)
    ]
    swa_idx = [
        torch.arange(s * window * ps, (s + 1) * window * ps, dtype=torch.int64)
        for s in range(n_spans)
    ]
    side = stack.side_specs
    span_bytes = sum(s.page_bytes * (min(window, span) if s.is_trailing else span) for s in side)
    out["flow_span_pages"] = span
    out["flow_span_bytes"] = span_bytes
    prefix = fresh_keys(4)
    use_v1 = {KVTIER: True, FILE: False}
    backend = {KVTIER: be.kv, FILE: be.file}
    cfgs = {KVTIER: be.kv_cfg, FILE: be.file_cfg}
    ops = {}

    def backup(which, keys, s):
        res = cf.backup_span(
            backend[which],
            stack,
            keys,
            {PoolName.KV: kv_idx[s], PoolName.SWA: swa_idx[s]},
            prefix_keys=prefix,
            use_v1=use_v1[which],
            storage_config=cfgs[which],
        )
        want = {str(x.name): (min(window, span) if x.is_trailing else span) for x in side}
        got = {str(k): v for k, v in res.pool_hits.items()}
        return res.completed_pages == span and all(got.get(k) == v for k, v in want.items())

    def backup_runner(which, reps):
        def setup(rep):
            if which == FILE:
                _file_set_setup(be.file, scale)
            else:
                be.kv.clear()
            return fresh_keys(span), rep % n_spans

        return _runner(setup, lambda a: backup(which, a[0], a[1]), Samples(span_bytes, span), reps)

    ops["flow_backup"] = _kvtier_vs_file(
        backup_runner, scale.flow_reps, scale.flow_reps_file, scale.rounds
    )

    be.kv.clear()
    be.file.clear()
    keys = [fresh_keys(span) for _ in range(n_spans)]
    for s in range(n_spans):
        for which in (KVTIER, FILE):
            assert backup(which, keys[s], s), f"{which} populate backup failed"

    def query_runner(which, reps):
        def timed(k):
            q = cf.query_span(backend[which], k, stack, prefix_keys=prefix)
            return q.kv_hit_pages == span

        return _runner(lambda rep: keys[rep % n_spans], timed, Samples(0, span), reps)

    ops["flow_query"] = _kvtier_vs_file(
        query_runner, scale.exists_reps_file, scale.exists_reps_file, scale.rounds
    )

    def prefetch(which, s):
        pre = cf.prefetch_span(
            backend[which],
            stack,
            keys[s],
            prefix_keys=prefix,
            use_v1=use_v1[which],
            host_indices_per_pool={PoolName.KV: kv_idx[s], PoolName.SWA: swa_idx[s]},
            storage_config=cfgs[which],
        )
        want = {x.name: (min(window, span) if x.is_trailing else span) for x in side}
        return pre.hit_pages == span and all(pre.counts.get(k) == v for k, v in want.items())

    restored = []
    for x in side:
        idx = swa_idx[0] if (x.is_trailing) else kv_idx[0]
        restored.append((x.host_pool, idx))
    snap = Snapshot(restored)
    ops["flow_prefetch"] = _verified_prefetch_flow(
        out, snap, prefetch, n_spans, Samples(span_bytes, span), scale, "dsv4: "
    )
    return ops


# --------------------------------------------------------------------------
# The whole run
# --------------------------------------------------------------------------

DSV4_OBJECT_SIZES = (1728, 16896, 32768, 74880, 131072, 599040)


def configure_runtime() -> None:
    """One torch intra-op thread: on a busy 2-core machine torch's parallel zero/copy kernels
    (used by SGLang's get_dummy_flat_data_page / set_from_flat_data_page, i.e. HiCacheFile's
    path) stall ~8 ms per call waiting for their second thread. One thread favours HiCacheFile."""
    torch.set_num_threads(1)
    quiet_logs()


def run_all(
    scale: Scale,
    *,
    storage_root: Optional[str] = None,
    only: Optional[Sequence[str]] = None,
    progress: Callable[[str], None] = lambda s: None,
) -> Dict[str, Any]:
    from kvtier_dev.bench import baselines, report

    configure_runtime()
    started = time.perf_counter()
    results: Dict[str, Any] = dict(
        machine=report.machine_info(), scale=dataclasses.asdict(scale), workloads=[]
    )
    results["scale"]["storage_root"] = storage_root or tempfile.gettempdir()
    sizes = list(scale.mha_components) + list(DSV4_OBJECT_SIZES)
    progress("memcpy baseline")
    start = baselines.measure(
        sizes, total=scale.memcpy_total, passes=scale.memcpy_passes, region=scale.region_bytes
    )
    plan: List[tuple] = [
        (f"mha-{_fmt_size(c)}", lambda c=c: mha_workload(scale, c, storage_root=storage_root))
        for c in scale.mha_components
    ]
    plan.append(("dsv4", lambda: dsv4_workload(scale, storage_root=storage_root)))
    for name, fn in plan:
        if only and not any(o in name for o in only):
            continue
        t0 = time.perf_counter()
        progress(f"{name} ...")
        results["workloads"].append(fn())
        progress(f"{name} done in {time.perf_counter() - t0:.1f} s")
    progress("memcpy baseline (end)")
    end = baselines.memcpy_stream(total=scale.memcpy_total, passes=scale.memcpy_passes)
    results["memcpy"] = dict(
        start=start["stream"],
        end=end,
        objects=start["objects"],
        reference_gbps=max(start["stream"]["best_gbps"], end["best_gbps"]),
        reference="best of the start and end passes of the 2 MiB-block streaming copy",
    )
    results["machine"]["loadavg_end"] = os.getloadavg()
    results["elapsed_s"] = time.perf_counter() - started
    verdicts = report.evaluate_targets(results)
    results["targets"] = [v.as_dict() for v in verdicts]
    return results
