"""SGLang's direct-linker chain, built from SGLang 0.5.23's real objects on CPU, for kvtier's
tests and benchmark of ``kvtier.sglang_linker`` (issue 18).

:func:`build` publishes ``ServerArgs(device="cpu", enable_unified_cache_external_linker=True,
unified_cache_external_linker_backend="dynamic", ...)``, allocates real device pools and
allocators on CPU, and calls ``mem_cache.registry.create_tree_cache``: SGLang's own factory
builds the ``UnifiedRadixCache``, imports and constructs the linker, wraps it and registers its
counter with the KV pool and the TP worker. The TP worker is a namespace carrying the real
``TpModelWorker`` methods (a full worker needs a model).

:class:`Flow` replays the scheduler's calls in its order (ENGINES_ON_CPU.md): ``insert`` →
``check_hicache_events`` → ``evict`` → ``match_prefix`` → ``init_load_back`` →
``prefix_device_indices`` → ``ready_to_load_host_cache`` → ``set_hicache_consumer`` → per-layer
``get_key_buffer`` / ``get_value_buffer`` → ``finish_external_linker_loads`` →
``checkpoint_into_tree`` → ``unlock``.
"""

from __future__ import annotations

import os
import time
from array import array
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Dict, List, Optional

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402

from sglang.srt.managers.schedule_batch import FINISH_LENGTH, Req  # noqa: E402
from sglang.srt.managers.tp_worker import TpModelWorker  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import (  # noqa: E402
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixKey  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402

KINDS = ("mha", "mla", "mha_swa", "dsa", "dsv4")


def linker_config(extra: Optional[dict] = None, linker: str = "KvtierLinker") -> dict:
    return {
        "linker": linker,
        "linker_module_path": "kvtier.sglang_linker",
        "linker_extra_config": dict(extra or {}),
    }


@dataclass
class Built:
    kind: str
    cache: Any
    kvcache: Any
    allocator: Any
    req_to_token_pool: Any
    tp_worker: Any
    page_size: int
    num_layers: int
    linker: Any = None
    # Device buffers whose bytes a restore must reproduce, per pool name.
    buffers: Dict[str, List[torch.Tensor]] = field(default_factory=dict)

    def close(self) -> None:
        self.cache.release_host_resources()


def _server_args(page_size: int, extra: dict, linker: str, **kw) -> ServerArgs:
    args = ServerArgs(
        model_path="dummy",
        device="cpu",
        page_size=page_size,
        enable_unified_cache_external_linker=True,
        unified_cache_external_linker_backend="dynamic",
        unified_cache_external_linker_config=linker_config(extra, linker),
        **kw,
    )
    set_global_server_args_for_scheduler(args)
    return args


def _tp_worker() -> Any:
    worker = SimpleNamespace(
        hicache_layer_transfer_counter=None,
        model_runner=SimpleNamespace(forward_stream=torch.cpu.Stream()),
    )
    worker.register_hicache_layer_transfer_counter = lambda counter: (
        TpModelWorker.register_hicache_layer_transfer_counter(worker, counter)
    )
    worker.set_hicache_consumer = lambda index: TpModelWorker.set_hicache_consumer(worker, index)
    return worker


def build(
    kind: str = "mha",
    *,
    extra: Optional[dict] = None,
    page_size: int = 4,
    num_layers: int = 4,
    pages: int = 64,
    head_num: int = 2,
    head_dim: int = 16,
    tree_core: str = "python",
    linker: str = "KvtierLinker",
    dtype: torch.dtype = torch.bfloat16,
) -> Built:
    """A UnifiedRadixCache with the kvtier linker, built by SGLang's factory."""
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import (
        MHATokenToKVPool,
        MLATokenToKVPool,
        ReqToTokenPool,
    )
    from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache

    server_args = _server_args(page_size, extra or {}, linker)
    size = pages * page_size
    req_to_token_pool = ReqToTokenPool(
        size=16, max_context_len=size + page_size, device="cpu", enable_memory_saver=False
    )
    is_swa = is_dsa = False
    full_tokens = None
    buffers: Dict[str, List[torch.Tensor]] = {}
    if kind == "mha":
        kv = MHATokenToKVPool(
            size=size,
            page_size=page_size,
            dtype=dtype,
            head_num=head_num,
            head_dim=head_dim,
            layer_num=num_layers,
            device="cpu",
            enable_memory_saver=False,
        )
        allocator = PagedTokenToKVPoolAllocator(size, page_size, dtype, "cpu", kv, need_sort=False)
        buffers["kv"] = [*kv.k_buffer, *kv.v_buffer]
    elif kind == "mla":
        kv = MLATokenToKVPool(
            size=size,
            page_size=page_size,
            dtype=dtype,
            kv_lora_rank=32,
            qk_rope_head_dim=16,
            layer_num=num_layers,
            device="cpu",
            enable_memory_saver=False,
        )
        allocator = PagedTokenToKVPoolAllocator(size, page_size, dtype, "cpu", kv, need_sort=False)
        buffers["kv"] = list(kv.kv_buffer)
    else:
        raise ValueError(f"unknown kind {kind!r}")

    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=page_size,
        tree_core_backend=tree_core,
    )
    worker = _tp_worker()
    ctx = TreeCacheBuildContext(
        server_args=server_args,
        params=params,
        is_hybrid_swa=is_swa,
        is_hybrid_ssm=False,
        enable_hierarchical_cache=False,
        disable_radix_cache=False,
        tp_worker=worker,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
        full_tokens_per_layer=full_tokens,
        is_dsa=is_dsa,
    )
    with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override(tree_core):
        cache = create_tree_cache(ctx)
    return Built(
        kind=kind,
        cache=cache,
        kvcache=kv,
        allocator=allocator,
        req_to_token_pool=req_to_token_pool,
        tp_worker=worker,
        page_size=page_size,
        num_layers=num_layers,
        linker=cache.linker.cache_linker,
        buffers=buffers,
    )


def tokens_for(seed: int, pages: int, page_size: int) -> List[int]:
    return [seed * 100_000 + i for i in range(pages * page_size)]


def fill_slots(built: Built, slots: torch.Tensor, seed: int) -> None:
    """Write a distinct pattern into every buffer's rows at ``slots``."""
    g = torch.Generator().manual_seed(seed)
    for bufs in built.buffers.values():
        for buf in bufs:
            rows = buf[slots]
            noise = torch.randint(-100, 100, rows.shape, generator=g).to(buf.dtype)
            buf[slots] = noise


def read_slots(built: Built, slots: torch.Tensor) -> List[torch.Tensor]:
    return [buf[slots].clone() for bufs in built.buffers.values() for buf in bufs]


def zero_all(built: Built) -> None:
    for bufs in built.buffers.values():
        for buf in bufs:
            buf.zero_()


def make_req(built: Built, rid: str, tokens: List[int]) -> Req:
    req = Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=array("q", tokens),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
    )
    built.req_to_token_pool.alloc([req])
    req.output_ids = array("q")
    req.full_untruncated_fill_ids = array("q", tokens)
    req.extend_end = len(tokens)
    req.lock = None
    req.extra_key = None
    return req


def wait_offloads(built: Built, timeout: float = 20.0) -> None:
    """Poll ``check_hicache_events`` (the scheduler's per-step call) until no offload is
    pending."""
    wrapper = built.cache.linker
    deadline = time.monotonic() + timeout
    while wrapper.pending_offloads:
        built.cache.check_hicache_events()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{len(wrapper.pending_offloads)} offloads still pending")
        time.sleep(0.002)


def produce(built: Built, tokens: List[int], seed: int) -> torch.Tensor:
    """Compute (fill) KV for ``tokens`` in fresh device slots and insert them: every new node
    is offloaded (write-through threshold 1). Returns the slots."""
    slots = built.allocator.alloc(len(tokens))
    assert slots is not None, "device pool full"
    fill_slots(built, slots, seed)
    built.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots.to(torch.int64)))
    return slots


def evict_all(built: Built) -> None:
    built.cache.evict(EvictParams(num_tokens=built.allocator.size))


@dataclass
class Restore:
    req: Req
    device_prefix_len: int
    host_hit_length: int
    loaded: int
    indices: torch.Tensor
    counter_index: int
    failed: List[Any]
    layer_wait_s: List[float]


def restore(built: Built, rid: str, tokens: List[int], *, insert_back: bool = True) -> Restore:
    """Replay the scheduler for a request whose prefix is (partly) in the store."""
    cache = built.cache
    req = make_req(built, rid, tokens)
    match = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens)), req=req))
    req.prefix_len = match.device_prefix_len
    req.last_node = match.last_device_node
    req.last_host_node = match.last_host_node
    req.best_match_node = match.best_match_node
    req.host_hit_length = match.host_hit_length
    req.swa_host_hit_length = match.swa_host_hit_length
    req.mamba_host_hit_length = match.mamba_host_hit_length
    req.lock = cache.lock(req.last_node) if hasattr(cache, "lock") else None
    loaded, last_node = cache.init_load_back(
        InitLoadBackParams(
            best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req
        )
    )
    req.host_loaded_length, req.last_node = loaded, last_node
    req.prefix_len = match.device_prefix_len + loaded
    indices = cache.prefix_device_indices(req).clone()
    index = cache.ready_to_load_host_cache()
    built.tp_worker.set_hicache_consumer(index)
    waits = []
    for layer in range(built.num_layers):
        t0 = time.perf_counter()
        built.kvcache.get_key_buffer(layer)
        built.kvcache.get_value_buffer(layer)
        waits.append(time.perf_counter() - t0)
    failed = cache.finish_external_linker_loads([req])
    if insert_back and not failed:
        # The forward computed the rest: give it slots, then insert as the scheduler does.
        rest = len(tokens) - req.prefix_len
        row = req.kv.req_pool_idx
        pool = built.req_to_token_pool
        pool.write((row, slice(0, req.prefix_len)), indices.to(torch.int32))
        if rest > 0:
            extra = built.allocator.alloc(rest)
            pool.write((row, slice(req.prefix_len, len(tokens))), extra.to(torch.int32))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = len(tokens)
        req.kv.cache_protected_len = match.device_prefix_len
        req.finished_reason = FINISH_LENGTH(length=0)
        cache.checkpoint_into_tree(req, up_to=len(tokens))
        cache.unlock(req.lock)
        req.lock = None
    return Restore(
        req, match.device_prefix_len, match.host_hit_length, loaded, indices, index, failed, waits
    )
