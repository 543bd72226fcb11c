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
    events: bool = False,
    **extra,
) -> OffloadingConfig:
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=BLOCK_TOKENS, layer_names=("model.layers.0.self_attn",), group_id=0
            ),
        ),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=events,
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


# ------------------------------------------------------------------ the v1 Scheduler, both roles
#
# A whole vLLM engine step on CPU: the real v1 ``Scheduler`` (KV cache manager, prefix
# hashing, the ``OffloadingConnector`` in the scheduler role with TieringOffloadingSpec, its
# manager, CPU primary tier and KvtierTier) and the ``OffloadingConnector`` in the worker role
# (its real job bookkeeping, deferred stores, device pointers from registered KV caches). Two
# substitutes: ``MemcpyTieringSpec`` hands the worker role a memcpy copy worker (the stock one
# refuses non-CUDA devices), and ``VllmInstance.forward`` writes ``block_bytes(hash)`` into each
# block a step computes (no model).

import ctypes  # noqa: E402

import torch  # noqa: E402

from vllm.v1.kv_offload.base import OffloadingWorker, TransferResult  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

LAYER = "model.layers.0.self_attn.attn"
NUM_KV_HEADS, HEAD_SIZE = 2, 16
MODEL_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_SIZE,
    "num_hidden_layers": 1,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}


class MemcpyWorker(OffloadingWorker):
    """Copies blocks between the CPU "GPU" KV tensors and the shared region, synchronously,
    in the order vLLM's DevicePointers list them (group, data ref, block); one block per
    chunk (blocks_per_chunk = 1), data refs concatenated inside the worker's chunk slot."""

    def __init__(self, region: SharedOffloadRegion, chunk_stride: int):
        self.region = region
        self.base = int(region.base_tensor.data_ptr())
        self.stride = chunk_stride
        self.done: list[TransferResult] = []

    def _copy(self, job_id, ptrs, chunk_ids, to_chunks: bool) -> bool:
        n_blocks = int(ptrs.group_block_counts[0])
        n_refs = int(ptrs.group_data_ref_counts[0])
        offset, moved = 0, 0
        for r in range(n_refs):
            for b in range(n_blocks):
                i = r * n_blocks + b
                dev, size = int(ptrs.ptrs[i]), int(ptrs.sizes[i])
                host = self.base + int(chunk_ids[b]) * self.stride + offset
                src, dst = (dev, host) if to_chunks else (host, dev)
                ctypes.memmove(dst, src, size)
                moved += size
            offset += int(ptrs.sizes[r * n_blocks]) if n_blocks else 0
        self.done.append(TransferResult(job_id=job_id, success=True, transfer_size=moved))
        return True

    def submit_store(self, job_id, device_ptrs, dst_spec) -> bool:
        return self._copy(job_id, device_ptrs, dst_spec.block_ids, True)

    def submit_load(self, job_id, src_spec, device_ptrs, expedited=False) -> bool:
        return self._copy(job_id, device_ptrs, src_spec.block_ids, False)

    def get_finished(self):
        out, self.done = self.done, []
        return out

    def wait(self, job_ids) -> None:
        return

    def shutdown(self) -> None:
        self.region.cleanup()


class MemcpyTieringSpec(TieringOffloadingSpec):
    """TieringOffloadingSpec whose worker copies with memcpy (no CUDA needed)."""

    def get_worker(self, kv_caches):
        if self._worker is None:
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._worker = MemcpyWorker(region, self.kv_bytes_per_chunk)
        return self._worker


def block_bytes(block_hash: bytes, size: int) -> bytes:
    return chunk_bytes(b"block:" + bytes(block_hash), size)


class VllmInstance:
    """One vLLM engine on CPU (see above). ``run(prompt)`` schedules one request to completion
    and returns ``(external_hit_tokens, {block index: bytes})`` of its full blocks."""

    def __init__(
        self, tmp_path, tiers, cpu_bytes=4 << 20, num_blocks=64, engine_id=None, kv_events=None
    ):
        import json as _json

        from vllm.config import (
            CacheConfig,
            DeviceConfig,
            KVTransferConfig,
            ModelConfig,
            SchedulerConfig,
            VllmConfig,
        )
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        model_dir = tmp_path / "llama-1l"
        model_dir.mkdir(exist_ok=True)
        (model_dir / "config.json").write_text(_json.dumps(MODEL_CONFIG))
        self.engine_id = engine_id or f"kvtier-test-{uuid.uuid4().hex[:8]}"
        vc = VllmConfig(
            model_config=ModelConfig(
                model=str(model_dir), skip_tokenizer_init=True, dtype="bfloat16", seed=0
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=8,
                max_num_batched_tokens=512,
                max_model_len=2048,
                is_encoder_decoder=False,
            ),
            cache_config=CacheConfig(block_size=BLOCK_TOKENS, enable_prefix_caching=True),
            kv_transfer_config=KVTransferConfig(
                kv_connector="OffloadingConnector",
                kv_role="kv_both",
                engine_id=self.engine_id,
                kv_connector_extra_config={
                    "spec_name": "MemcpyTieringSpec",
                    "spec_module_path": "_vllm_engine",
                    "cpu_bytes_to_use": cpu_bytes,
                    "secondary_tiers": tiers,
                },
            ),
            device_config=DeviceConfig("cpu"),
            # vLLM's own KV-event publisher (issue 30): a KVEventsConfig or None.
            kv_events_config=kv_events,
        )
        spec = FullAttentionSpec(
            block_size=BLOCK_TOKENS,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_SIZE,
            dtype=torch.bfloat16,
        )
        kcc = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec([LAYER], spec)],
        )
        vc.cache_config.num_gpu_blocks = num_blocks
        self.vllm_config = vc
        self.page = spec.page_size_bytes
        self.scheduler = Scheduler(
            vllm_config=vc,
            kv_cache_config=kcc,
            log_stats=True,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=BLOCK_TOKENS,
        )
        self.worker = OffloadingConnector(vc, KVConnectorRole.WORKER, kcc)
        # The "GPU" KV cache: (num_blocks, 2, block, heads, head) bf16 on CPU.
        self.kv = torch.zeros(
            (num_blocks, 2, BLOCK_TOKENS, NUM_KV_HEADS, HEAD_SIZE), dtype=torch.bfloat16
        )
        self.worker.register_kv_caches({LAYER: self.kv})
        self.kv_bytes = self.kv.view(torch.uint8).view(num_blocks, -1)
        self.manager = self.scheduler.connector.scheduler.manager
        self.tier = self.manager.secondary_tiers[0]
        self._n = 0
        self.seen: dict[str, dict[int, bytes]] = {}
        # Tokens the substitute forward computed per request (loaded ones are not).
        self.computed: dict[str, int] = {}

    def _request(self, prompt):
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.request import Request

        init_none_hash(sha256)
        self._n += 1
        sp = SamplingParams(max_tokens=1)
        sp.update_from_generation_config({}, 999)
        return Request(
            request_id=f"req-{self._n}",
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            mm_features=None,
            block_hasher=get_request_block_hasher(BLOCK_TOKENS, sha256),
        )

    def forward(self, so):
        """The substitute model: each block a step completes gets its hash's bytes."""
        for req_id, n in so.num_scheduled_tokens.items():
            self.computed[req_id] = self.computed.get(req_id, 0) + n
            req = self.scheduler.requests[req_id]
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            start = req.num_computed_tokens - n  # schedule() already advanced it
            for i in range(start // BLOCK_TOKENS, (start + n) // BLOCK_TOKENS):
                if i < len(req.block_hashes):
                    data = block_bytes(req.block_hashes[i], self.kv_bytes.shape[1])
                    self.kv_bytes[blocks[i]] = torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def step(self):
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        so = self.scheduler.schedule()
        self.worker.bind_connector_metadata(so.kv_connector_metadata)
        self.worker.start_load_kv(None)
        self.forward(so)
        # What each scheduled request's blocks hold after this step's loads and forward.
        for req_id in so.num_scheduled_tokens:
            req = self.scheduler.requests[req_id]
            blocks = self.scheduler.kv_cache_manager.get_block_ids(req_id)[0]
            seen = self.seen.setdefault(req_id, {})
            for i in range(min(len(blocks), len(req.block_hashes))):
                seen[i] = bytes(self.kv_bytes[blocks[i]].numpy())
        self.worker.wait_for_save()
        sending, recving = self.worker.get_finished(so.finished_req_ids)
        meta = self.worker.build_connector_worker_meta()
        self.worker.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        out = ModelRunnerOutput(
            req_ids=req_ids,
            sampled_token_ids=[[7] for _ in req_ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending or None,
                finished_recving=recving or None,
                kv_connector_worker_meta=meta,
            ),
        )
        self.scheduler.update_from_output(so, out)
        return so

    def run(self, prompt, timeout=30.0):
        req = self._request(prompt)
        self.scheduler.add_request(req)
        deadline = time.monotonic() + timeout
        while True:
            so = self.step()
            if req.is_finished() and not self.scheduler.has_requests():
                break
            assert time.monotonic() < deadline, "request did not finish"
            if not so.num_scheduled_tokens:
                time.sleep(0.001)
        # Let the offloads and cascades of this request finish (idle steps yield).
        while self.scheduler.has_unfinished_requests() or self.manager.has_pending_work():
            self.step()
            assert time.monotonic() < deadline, "offloads did not finish"
            time.sleep(0.001)
        return req, self.seen.pop(req.request_id, {})

    def expected(self, req) -> dict[int, bytes]:
        return {i: block_bytes(h, self.kv_bytes.shape[1]) for i, h in enumerate(req.block_hashes)}

    def wipe(self):
        """Drop every cached copy of KV this instance holds: GPU prefix cache and blocks, and
        the CPU primary tier (kvtier keeps its copy)."""
        assert self.scheduler.reset_prefix_cache(reset_connector=True)
        self.kv.zero_()
        with self.manager.lock:
            self.manager.on_reset_flushed()

    def close(self):
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self.worker.shutdown()
        self.scheduler.shutdown()
