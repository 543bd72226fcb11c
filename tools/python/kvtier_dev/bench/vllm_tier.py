"""``python -m kvtier_dev.bench.vllm_tier``: kvtier as a vLLM 0.34.0 secondary tier, store and load
GB/s against the same run's memcpy and vLLM's in-tree ``fs`` tier (issue 19).

Both tiers are built by vLLM's own ``SecondaryTierFactory`` over one primary region (an int8
``(2 * chunks, stride)`` view, as vLLM's CPU primary tier hands it) with a real
``TieringOffloadingSpec``; each repetition submits one ``TransferJob`` per ``--job-chunks``
chunks the way the tiering manager does (store: chunks ``[0, n)`` to the tier; load: back into
chunks ``[n, 2n)``) and polls ``get_finished_jobs()`` until every job is done, yielding while
idle. The loaded bytes are checked against the stored ones. memcpy is numpy copying the same
chunks inside the region. The ``fs`` tier writes under ``--fs-dir`` (a fresh directory, removed
after; page cache included, as vLLM runs it by default).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import statistics
import tempfile
import time
import uuid

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import numpy as np  # noqa: E402


def _spec(stride: int, chunks: int):
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingGroupConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    cfg = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0",), group_id=0),),
        worker_kv_bytes_per_block=stride,
        enable_kv_cache_events=False,
        extra_config={"cpu_bytes_to_use": stride * chunks * 2, "secondary_tiers": []},
        engine_id=f"kvtier-bench-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name="kvtier-bench/model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    return TieringOffloadingSpec(cfg)


def _run_jobs(tier, keys, chunk_ids, job_chunks, load, first_id):
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    ctx = ReqContext(req_id="bench")
    pending = set()
    t0 = time.perf_counter()
    for j, i in enumerate(range(0, len(keys), job_chunks)):
        job = TransferJob(
            job_id=first_id + j,
            keys=keys[i : i + job_chunks],
            chunk_ids=np.asarray(chunk_ids[i : i + job_chunks], dtype=np.int64),
            is_promotion=load,
            req_context=ctx,
        )
        pending.add(job.job_id)
        (tier.submit_load if load else tier.submit_store)(job)
    failed = 0
    while pending:
        for r in tier.get_finished_jobs():
            pending.discard(r.job_id)
            failed += 0 if r.success else 1
        if pending:
            time.sleep(0.0002)
    return time.perf_counter() - t0, failed


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m kvtier_dev.bench.vllm_tier", description=__doc__)
    p.add_argument("--chunks", type=int, default=256)
    p.add_argument("--chunk-kib", type=int, default=1024)
    p.add_argument("--job-chunks", type=int, default=32, help="chunks per TransferJob")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--server-socket", help="use a running `kvtier serve` instead of embedded")
    p.add_argument("--fs-dir", default=None, help="parent directory of the fs tier's files")
    p.add_argument("--json", metavar="PATH")
    args = p.parse_args(argv)

    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    n, stride = args.chunks, args.chunk_kib * 1024
    # Like vLLM's primary region: a MAP_SHARED file /dev/shm/vllm_offload_<engine_id>.mmap
    # (page-aligned: the fs tier uses O_DIRECT where it can; kvtier serve maps the file).
    spec = _spec(stride, n)
    region_path = f"/dev/shm/vllm_offload_{spec.config.engine_id}.mmap"
    fd = os.open(region_path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 2 * n * stride)
    backing = mmap.mmap(fd, 2 * n * stride)
    os.close(fd)
    region = np.frombuffer(backing, dtype=np.int8).reshape(2 * n, stride)
    rng = np.random.default_rng(7)
    region[:n] = rng.integers(-128, 127, size=(n, stride), dtype=np.int8)
    view = memoryview(region)
    nbytes = n * stride
    fs_root = tempfile.mkdtemp(prefix="kvtier-bench-fs-", dir=args.fs_dir)
    kvtier_cfg = {"type": "KvtierTier", "module_path": "kvtier.vllm"}
    if args.server_socket:
        kvtier_cfg["server_socket"] = args.server_socket
    else:
        kvtier_cfg["dram_capacity_bytes"] = nbytes * 2 + (64 << 20)
    tiers = {
        "kvtier": SecondaryTierFactory.create_secondary_tier(kvtier_cfg, view, spec),
        "fs": SecondaryTierFactory.create_secondary_tier(
            {"type": "fs", "root_dir": fs_root}, view, spec
        ),
    }
    results: dict = {"chunks": n, "chunk_bytes": stride, "job_chunks": args.job_chunks, "runs": {}}
    samples: dict = {
        k: [] for k in ("memcpy", "kvtier_store", "kvtier_load", "fs_store", "fs_load")
    }
    job_id = 0
    try:
        for rep in range(args.repeat):
            # Fresh keys each repetition: every store writes new objects.
            keys = [
                make_offload_key(f"rep{rep}-{i}".encode().ljust(32, b"\0"), 0) for i in range(n)
            ]
            t0 = time.perf_counter()
            region[n:] = region[:n]
            samples["memcpy"].append(nbytes / (time.perf_counter() - t0) / 1e9)
            for name, tier in tiers.items():  # interleaved: same machine state for both
                region[n:] = 0
                dt, failed = _run_jobs(tier, keys, list(range(n)), args.job_chunks, False, job_id)
                job_id += n
                assert failed == 0, f"{name}: {failed} store jobs failed"
                samples[f"{name}_store"].append(nbytes / dt / 1e9)
                dt, failed = _run_jobs(
                    tier, keys, list(range(n, 2 * n)), args.job_chunks, True, job_id
                )
                job_id += n
                assert failed == 0, f"{name}: {failed} load jobs failed"
                assert np.array_equal(region[n:], region[:n]), f"{name}: loaded bytes differ"
                samples[f"{name}_load"].append(nbytes / dt / 1e9)
    finally:
        for tier in tiers.values():
            tier.shutdown()
        shutil.rmtree(fs_root, ignore_errors=True)
        del view, region
        try:
            backing.close()
        except BufferError:  # a tier still holds a view; the process exit unmaps it
            pass
        os.unlink(region_path)
    for k, v in samples.items():
        results["runs"][k] = {"median_gbps": statistics.median(v), "samples_gbps": v}
    r = results["runs"]
    mode = "server" if args.server_socket else "embedded"
    print(
        f"vLLM secondary tier, {n} chunks x {args.chunk_kib} KiB, {args.job_chunks} chunks/job, "
        f"median of {args.repeat} (kvtier {mode})"
    )
    print(f"{'':10} {'store GB/s':>11} {'load GB/s':>10}")
    print(f"{'memcpy':10} {r['memcpy']['median_gbps']:>11.2f} {r['memcpy']['median_gbps']:>10.2f}")
    for name in ("kvtier", "fs"):
        print(
            f"{name:10} {r[name + '_store']['median_gbps']:>11.2f} "
            f"{r[name + '_load']['median_gbps']:>10.2f}"
        )
    print(
        f"kvtier/fs: store {r['kvtier_store']['median_gbps'] / r['fs_store']['median_gbps']:.1f}x, "
        f"load {r['kvtier_load']['median_gbps'] / r['fs_load']['median_gbps']:.1f}x"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return results


if __name__ == "__main__":
    main()
