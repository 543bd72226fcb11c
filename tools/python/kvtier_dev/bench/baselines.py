"""This machine's memcpy, measured in the same run as the workloads it is compared with.

* ``memcpy_stream``: single-thread ``np.copyto`` (and, alternated with it, libc ``memmove``)
  of ``block`` -byte blocks walking a ``total`` -byte source and destination (both
  pre-faulted), so the data is not in any CPU cache; best and median of N passes of each.
  The best of them is the reference every throughput is divided by.
* ``memcpy_objects``: single-thread copies of ``size`` -byte objects gathered in random order
  from a ``region`` -byte source into a contiguous destination (``np.take`` along axis 0: one
  ``memmove`` per object, no Python per object), the access pattern of a 128-page batch at
  that object size.
"""

from __future__ import annotations

import ctypes
import statistics
from typing import Dict, Sequence

import numpy as np

from kvtier_dev.bench.timing import gc_paused, now_ns

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


def _prefaulted(nbytes: int, value: int) -> np.ndarray:
    a = np.empty(nbytes, dtype=np.uint8)
    a.fill(value)
    return a


def memcpy_stream(total: int = GiB, block: int = 2 * MiB, passes: int = 5) -> Dict[str, float]:
    total -= total % block
    src = _prefaulted(total, 1)
    dst = _prefaulted(total, 2)
    gbps, libc = [], []
    ps, pd = src.ctypes.data, dst.ctypes.data
    with gc_paused():
        for _ in range(passes):
            t0 = now_ns()
            for off in range(0, total, block):
                np.copyto(dst[off : off + block], src[off : off + block])
            gbps.append(total / (now_ns() - t0))
            # The same walk through libc memmove (what a native memcpy does), alternated with
            # numpy so a noisy phase hits both; the reference is the best of either.
            t0 = now_ns()
            for off in range(0, total, block):
                ctypes.memmove(pd + off, ps + off, block)
            libc.append(total / (now_ns() - t0))
    del src, dst
    return dict(
        block_bytes=block,
        total_bytes=total,
        passes=passes,
        best_gbps=max(gbps + libc),
        median_gbps=statistics.median(gbps + libc),
        numpy_copyto_gbps=gbps,
        libc_memmove_gbps=libc,
    )


def memcpy_objects(
    size: int, region: int = 256 * MiB, objects: int = 256, passes: int = 5, seed: int = 1
) -> Dict[str, float]:
    """Copy ``objects`` objects of ``size`` bytes (random picks from a ``region`` source)."""
    n_src = max(objects, region // size)
    src = _prefaulted(n_src * size, 3).reshape(n_src, size)
    dst = _prefaulted(objects * size, 4).reshape(objects, size)
    rng = np.random.default_rng(seed)
    gbps = []
    with gc_paused():
        for _ in range(passes):
            pick = rng.choice(n_src, size=objects, replace=False)
            t0 = now_ns()
            np.take(src, pick, axis=0, out=dst, mode="clip")  # "raise" buffers out
            gbps.append(objects * size / (now_ns() - t0))
    del src, dst
    return dict(
        object_bytes=size,
        objects=objects,
        region_bytes=n_src * size,
        passes=passes,
        best_gbps=max(gbps),
        median_gbps=statistics.median(gbps),
    )


def measure(
    object_sizes: Sequence[int], *, total: int, passes: int, region: int
) -> Dict[str, object]:
    stream = memcpy_stream(total=total, passes=passes)
    per_size = {}
    for size in sorted(set(int(s) for s in object_sizes)):
        objects = max(16, min(1024, (64 * MiB) // size))
        per_size[str(size)] = memcpy_objects(
            size, region=max(region, 2 * objects * size), objects=objects, passes=passes
        )
    return dict(stream=stream, objects=per_size)
