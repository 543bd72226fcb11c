"""Where kvtier's time goes in one SGLang call: ``python -m kvtier_dev.bench profile``.

Splits the median wall time of kvtier's adapter calls into

* ``sglang_meta``: SGLang's ``get_page_buffer_meta`` (pointer/size lists, ``indices.tolist()``),
* ``native``: the ``kvtier._native.Store`` call (GIL released: key composition, index, copy),
* ``adapter``: the rest, i.e. kvtier's Python adapter (argument lists, checks, result folding),

by timing the pieces inside the same calls (a forwarding proxy around ``_native.Store`` and a
wrapper around the pool's ``get_page_buffer_meta``), plus a cProfile of the hottest functions.
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
from typing import Any, Callable, Dict, List

import torch

from kvtier_dev.bench import sglang_workloads as bw
from kvtier_dev.bench.timing import gc_paused, now_ns

import kvtier_dev.harness.flows as cf
import kvtier_dev.harness.pools as sp
from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

MiB = 1 << 20


class _Clock:
    def __init__(self):
        self.ns: Dict[str, int] = {}

    def wrap(self, label: str, fn: Callable) -> Callable:
        def timed(*a, **k):
            t0 = now_ns()
            try:
                return fn(*a, **k)
            finally:
                self.ns[label] = self.ns.get(label, 0) + now_ns() - t0

        return timed

    def reset(self):
        self.ns.clear()


class _StoreProxy:
    """Forwards to a ``_native.Store``, timing every call under ``native``."""

    def __init__(self, inner, clock: _Clock):
        self._inner = inner
        self._clock = clock

    def __getattr__(self, name):
        attr = getattr(self._inner, name)
        return self._clock.wrap("native", attr) if callable(attr) else attr


def _instrument(kv, pools, clock: _Clock) -> None:
    kv._store = _StoreProxy(kv._store, clock)
    for pool in pools:
        pool.get_page_buffer_meta = clock.wrap("sglang_meta", pool.get_page_buffer_meta)


def _split(call: Callable[[], Any], clock: _Clock, reps: int) -> Dict[str, float]:
    totals: List[int] = []
    parts: Dict[str, List[int]] = {"native": [], "sglang_meta": []}
    with gc_paused():
        call()
        for _ in range(reps):
            clock.reset()
            t0 = now_ns()
            call()
            totals.append(now_ns() - t0)
            for k in parts:
                parts[k].append(clock.ns.get(k, 0))
    adapter = [t - sum(parts[k][i] for k in parts) for i, t in enumerate(totals)]
    out = dict(
        total_us=statistics.median(totals) / 1e3, adapter_us=statistics.median(adapter) / 1e3
    )
    out.update({f"{k}_us": statistics.median(v) / 1e3 for k, v in parts.items()})
    return out


def _cprofile(call: Callable[[], Any], reps: int, top: int = 12) -> str:
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        call()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
    lines = [l for l in buf.getvalue().splitlines() if l.strip()]
    start = next((i for i, l in enumerate(lines) if l.lstrip().startswith("ncalls")), 0)
    return "\n".join(lines[start : start + top + 1])


def profile_mha(component_bytes: int, reps: int = 30, batch: int = 128) -> Dict[str, Any]:
    geom = bw.mha_geometry(component_bytes)
    pool = sp.build_mha_host_pool("page_first", size_pages=batch, device_pages=4, **geom)
    bw.fill_random(pool, 1)
    be = bw.open_backends(
        pool, is_mla=False, capacity=batch * 2 * component_bytes * 2 + 64 * MiB, storage_root=None
    )
    clock = _Clock()
    try:
        kv = be.kv
        idx = sp.alloc_indices(pool, batch)
        keys = bw.fresh_keys(batch)
        extra = bw._extra()
        assert all(kv.batch_set_v1(keys, idx, extra))
        _instrument(kv, [pool], clock)

        def fresh_set():
            kv._store._inner.clear()
            return kv.batch_set_v1(bw.fresh_keys(batch), idx, extra)

        # set: clear + fresh keys happen inside the call we time, so time them apart.
        set_keys = [bw.fresh_keys(batch) for _ in range(reps + 1)]
        it = iter(set_keys)

        def one_set():
            kv._store._inner.clear()
            clock.ns.pop("native", None)
            t0 = now_ns()
            kv.batch_set_v1(next(it), idx, extra)
            clock.ns["_set_total"] = now_ns() - t0

        sets = []
        with gc_paused():
            for _ in range(reps):
                clock.reset()
                one_set()
                sets.append(
                    (
                        clock.ns["_set_total"],
                        clock.ns.get("native", 0),
                        clock.ns.get("sglang_meta", 0),
                    )
                )
        set_split = dict(
            total_us=statistics.median(s[0] for s in sets) / 1e3,
            native_us=statistics.median(s[1] for s in sets) / 1e3,
            sglang_meta_us=statistics.median(s[2] for s in sets) / 1e3,
            adapter_us=statistics.median(s[0] - s[1] - s[2] for s in sets) / 1e3,
        )
        kv._store._inner.clear()
        assert all(kv.batch_set_v1(keys, idx, extra))
        get_split = _split(lambda: kv.batch_get_v1(keys, idx, extra), clock, reps)
        nbytes = batch * 2 * component_bytes
        for s in (set_split, get_split):
            s["gbps"] = nbytes / (s["total_us"] * 1e3)
            s["native_gbps"] = nbytes / (s["native_us"] * 1e3) if s["native_us"] else float("nan")
        return dict(
            workload=f"mha-{bw._fmt_size(component_bytes)}",
            bytes=nbytes,
            set=set_split,
            get=get_split,
            get_cprofile=_cprofile(lambda: kv.batch_get_v1(keys, idx, extra), reps),
        )
    finally:
        be.close()


def profile_dsv4_exists(
    reps: int = 500, batch: int = 128, device_pages: int = 64
) -> Dict[str, Any]:
    stack = sp.build_dsv4_pool_group(
        "page_first", device_full_pages=device_pages, device_swa_pages=device_pages
    )
    be = bw.open_backends(stack, is_mla=True, capacity=512 * MiB, storage_root=None)
    clock = _Clock()
    try:
        kv = be.kv
        ps = stack.page_size
        idx = torch.arange(0, batch * ps, dtype=torch.int64)
        keys = bw.fresh_keys(batch)
        extra = bw._extra()
        t = [
            PoolTransfer(name=s.name, keys=keys, host_indices=idx, hit_policy=s.hit_policy)
            for s in stack.side_specs
        ]
        assert bw._all_true_v2(kv.batch_set_v2(t, extra), t)
        _instrument(kv, [s.host_pool for s in stack.side_specs], clock)
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
        out: Dict[str, Any] = dict(workload="dsv4")
        for label, specs in (
            ("exists_v2_4pools", four),
            ("exists_v2_all_pools", list(stack.specs)),
        ):
            q = cf.build_prefetch_transfers(batch, specs)
            out[label] = _split(lambda: kv.batch_exists_v2(keys, q, extra), clock, reps)
            out[label]["pools"] = len(q)
        q = cf.build_prefetch_transfers(batch, list(stack.specs))
        out["exists_cprofile"] = _cprofile(lambda: kv.batch_exists_v2(keys, q, extra), reps)
        out["get_v2"] = _split(lambda: kv.batch_get_v2(t, extra), clock, 20)
        out["get_v2"]["bytes"] = batch * sum(s.page_bytes for s in stack.side_specs)
        return out
    finally:
        be.close()


def profile_flows(
    component_bytes: int = 32 * 1024, span: int = 256, reps: int = 20
) -> Dict[str, Any]:
    """``prefetch_span`` / ``backup_span`` on kvtier: the backend's share vs the harness and
    SGLang controller code around it."""
    geom = bw.mha_geometry(component_bytes)
    pool = sp.build_mha_host_pool("page_first", size_pages=span, device_pages=4, **geom)
    bw.fill_random(pool, 2)
    be = bw.open_backends(
        pool, is_mla=False, capacity=span * 2 * component_bytes * 2 + 64 * MiB, storage_root=None
    )
    clock = _Clock()
    try:
        kv = be.kv
        idx = sp.alloc_indices(pool, span)
        keys = bw.fresh_keys(span)
        prefix = bw.fresh_keys(4)
        res = cf.backup_span(
            kv,
            pool,
            keys,
            {PoolName.KV: idx},
            prefix_keys=prefix,
            use_v1=True,
            storage_config=be.kv_cfg,
        )
        assert res.completed_pages == span
        for name in (
            "batch_get_v1",
            "batch_set_v1",
            "batch_exists",
            "batch_exists_v2",
            "batch_get_v2",
        ):
            setattr(kv, name, clock.wrap("backend", getattr(kv, name)))

        def split(call):
            totals, backend = [], []
            with gc_paused():
                call()
                for _ in range(reps):
                    clock.reset()
                    t0 = now_ns()
                    call()
                    totals.append(now_ns() - t0)
                    backend.append(clock.ns.get("backend", 0))
            return dict(
                total_us=statistics.median(totals) / 1e3,
                backend_us=statistics.median(backend) / 1e3,
                controller_and_harness_us=statistics.median(t - b for t, b in zip(totals, backend))
                / 1e3,
            )

        pre = split(
            lambda: cf.prefetch_span(
                kv,
                pool,
                keys,
                prefix_keys=prefix,
                use_v1=True,
                host_indices_per_pool={PoolName.KV: idx},
                storage_config=be.kv_cfg,
            )
        )
        qry = split(lambda: cf.query_span(kv, keys, pool, prefix_keys=prefix))
        mk = split(lambda: cf.make_controller(kv, pool, use_v1=True, storage_config=be.kv_cfg))
        return dict(
            workload=f"mha-{bw._fmt_size(component_bytes)} span {span}",
            prefetch_span=pre,
            query_span=qry,
            make_controller=mk,
        )
    finally:
        be.close()


def run(quick: bool = False) -> Dict[str, Any]:
    bw.configure_runtime()
    sizes = (32 * 1024, 256 * 1024) if quick else (32 * 1024, 64 * 1024, 256 * 1024, 2 * MiB)
    reps = 10 if quick else 30
    return dict(
        mha=[profile_mha(c, reps=reps) for c in sizes],
        dsv4=profile_dsv4_exists(reps=200 if quick else 1000),
        flows=profile_flows(reps=reps),
    )


def format_report(r: Dict[str, Any]) -> str:
    lines = [
        "kvtier call time split (median us per 128-page call): total = native + sglang_meta + adapter"
    ]
    for m in r["mha"]:
        for op in ("set", "get"):
            s = m[op]
            lines.append(
                f"  {m['workload']:<11} {op:<4} total {s['total_us']:8.1f}  native {s['native_us']:8.1f} "
                f"({s['native_gbps']:.2f} GB/s)  sglang_meta {s['sglang_meta_us']:6.1f}  adapter {s['adapter_us']:6.1f}"
                f"  -> {s['gbps']:.2f} GB/s"
            )
    d = r["dsv4"]
    for label in ("exists_v2_4pools", "exists_v2_all_pools"):
        s = d[label]
        lines.append(
            f"  dsv4 {label} ({s['pools']} pools): total {s['total_us']:.1f}  native {s['native_us']:.1f}  "
            f"adapter {s['adapter_us']:.1f}"
        )
    s = d["get_v2"]
    lines.append(
        f"  dsv4 batch_get_v2: total {s['total_us']:.1f}  native {s['native_us']:.1f}  sglang_meta "
        f"{s['sglang_meta_us']:.1f}  adapter {s['adapter_us']:.1f}  -> {s['bytes'] / (s['total_us'] * 1e3):.2f} GB/s"
    )
    f = r["flows"]
    for k in ("prefetch_span", "query_span", "make_controller"):
        s = f[k]
        lines.append(
            f"  {f['workload']} {k}: total {s['total_us']:.1f}  in backend calls {s['backend_us']:.1f}  "
            f"controller+harness {s['controller_and_harness_us']:.1f}"
        )
    lines.append("")
    lines.append(f"cProfile, {r['mha'][0]['workload']} batch_get_v1 (tottime):")
    lines.append(r["mha"][0]["get_cprofile"])
    lines.append("")
    lines.append("cProfile, dsv4 batch_exists_v2 all pools (tottime):")
    lines.append(d["exists_cprofile"])
    return "\n".join(lines)
