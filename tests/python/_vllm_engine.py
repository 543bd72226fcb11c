"""A vLLM 0.34.0 offloading stack on CPU for kvtier's tier tests and benchmark (issue 19).

Real vLLM objects: ``OffloadingConfig``, ``OffloadingSpecFactory`` -> ``TieringOffloadingSpec``,
its ``TieringOffloadingManager`` with the ``CPUPrimaryTierOffloadingManager`` over a real
``SharedOffloadRegion`` (``/dev/shm/vllm_offload_<engine_id>.mmap``), and the secondary tier
built by vLLM's ``SecondaryTierFactory`` from the tier config (``module_path`` import).

Substituted, because there is no GPU: the GPU->CPU copy of the stock worker (refuses non-CUDA
devices) and the model forward. ``Engine.offload`` plays the worker: it writes deterministic
bytes per chunk (``chunk_bytes``) into the primary chunks vLLM's manager allocated, then
completes the store as the worker would, which makes the manager cascade to the tier.
``Engine.fetch`` is the scheduler's lookup loop (lookup / on_schedule_end until HIT or MISS,
yielding while idle) followed by reading the chunk back from the primary region.
"""

from __future__ import annotations

import glob
import hashlib
import os
import time
import uuid

import numpy as np

from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext, make_offload_key
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

BLOCK_TOKENS = 16


def remove_leftover_regions() -> None:
    """A crashed run leaves its shared regions in /dev/shm: remove them."""
    for path in glob.glob("/dev/shm/vllm_offload_*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def chunk_bytes(key: bytes, size: int) -> bytes:
    """Deterministic content of one chunk (the substitute forward's output)."""
    out = bytearray()
    counter = 0
    while len(out) < size:
        out += hashlib.sha256(key + counter.to_bytes(8, "little")).digest()
        counter += 1
    return bytes(out[:size])


def offloading_config(
    tiers: list[dict],
    cpu_bytes: int,
    block_bytes: int,
    model: str = "kvtier-test/llama-1l",
    engine_id: str | None = None,
    **extra,
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=BLOCK_TOKENS, layer_names=("model.layers.0.self_attn",), group_id=0
            ),
        ),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": tiers,
            **extra,
        },
        engine_id=engine_id or f"kvtier-test-{uuid.uuid4().hex[:8]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK_TOKENS, blocks_per_chunk=1),
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


def request_keys(prompt_id: str, n: int) -> list[bytes]:
    """OffloadKeys of a request's ``n`` chained blocks (block hash + group 0)."""
    keys, parent = [], prompt_id.encode()
    for _ in range(n):
        parent = hashlib.sha256(parent).digest()
        keys.append(make_offload_key(parent, 0))
    return keys


class Engine:
    """One vLLM instance's scheduler-side offloading stack."""

    def __init__(
        self, tiers: list[dict], cpu_bytes: int = 64 << 20, block_bytes: int = 64 << 10, **kw
    ):
        self.config = offloading_config(tiers, cpu_bytes, block_bytes, **kw)
        self.spec = OffloadingSpecFactory.create_spec(self.config)
        self.manager = self.spec.get_manager()
        self.primary = self.manager.primary_tier
        self.tier = self.manager.secondary_tiers[0] if self.manager.secondary_tiers else None
        self.view = self.primary.get_kv_memoryview()
        self.stride = self.view.strides[0]
        self._arr = np.frombuffer(self.view, dtype=np.uint8).reshape(-1, self.stride)
        self._n = 0

    def _ctx(self) -> ReqContext:
        self._n += 1
        ctx = ReqContext(req_id=f"req-{self._n}")
        self.manager.on_new_request(ctx)
        return ctx

    def step_end(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout: float = 30.0) -> None:
        """Step until the tier has nothing in flight (idle steps yield the CPU)."""
        deadline = time.monotonic() + timeout
        while True:
            with self.manager.lock:
                self.step_end()
                busy = self.manager.has_pending_work()
            if not busy:
                return
            assert time.monotonic() < deadline, "tier jobs did not finish"
            time.sleep(0.001)

    def offload(self, keys: list[bytes]) -> None:
        """Store chunks GPU->primary (substitute worker: deterministic bytes) -> cascade."""
        ctx = self._ctx()
        with self.manager.lock:
            out = self.manager.prepare_store(keys, ctx)
            assert out is not None, "primary tier refused the store"
            for key, cid in zip(out.keys_to_store, out.store_spec.chunk_ids):
                self._arr[int(cid)] = np.frombuffer(chunk_bytes(key, self.stride), dtype=np.uint8)
            if out.keys_to_store:
                self.manager.complete_store(out.keys_to_store, ctx)
            self.manager.on_request_finished(ctx)
        self.settle()

    def wipe_primary(self) -> None:
        """Drop every primary chunk (vLLM's reset_cache) and zero the region."""
        with self.manager.lock:
            self.manager.reset_cache()
            self.manager.on_reset_flushed()
        self._arr[:] = 0

    def fetch(self, keys: list[bytes], timeout: float = 30.0) -> dict[bytes, bytes | None]:
        """The scheduler's lookup loop, then each HIT chunk's bytes from the primary region."""
        ctx = self._ctx()
        out: dict[bytes, bytes | None] = {}
        deadline = time.monotonic() + timeout
        for key in keys:
            while True:
                with self.manager.lock:
                    r = self.manager.lookup(key, ctx)
                    if r in (LookupResult.RETRY, LookupResult.HIT_PENDING):
                        self.step_end()
                if r is LookupResult.HIT:
                    with self.manager.lock:
                        spec = self.manager.prepare_load([key], ctx)
                        cid = int(spec.chunk_ids[0])
                        out[key] = bytes(self._arr[cid])
                        self.manager.complete_load([key], ctx)
                    break
                if r is LookupResult.MISS:
                    out[key] = None
                    break
                assert time.monotonic() < deadline, f"lookup stuck at {r}"
                time.sleep(0.001)
        with self.manager.lock:
            self.manager.on_request_finished(ctx)
        return out

    def close(self) -> None:
        del self._arr
        self.view = None
        self.manager.shutdown()
