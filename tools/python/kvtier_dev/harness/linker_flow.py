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

import ctypes
import os
import time
from array import array
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, List, Optional

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
    module = (
        "kvtier.sglang_linker_staging"
        if linker == "KvtierStagingLinker"
        else "kvtier.sglang_linker"
    )
    return {
        "linker": linker,
        "linker_module_path": module,
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
    window: int = 0
    linker: Any = None

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
    window: int = 8,
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
    elif kind == "mha_swa":
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
        from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

        full_ids = list(range(0, num_layers, 2))
        swa_ids = list(range(1, num_layers, 2))
        kv = SWAKVPool(
            size=size,
            size_swa=size,
            page_size=page_size,
            dtype=dtype,
            head_num=head_num,
            head_dim=head_dim,
            swa_attention_layer_ids=swa_ids,
            full_attention_layer_ids=full_ids,
            device="cpu",
        )
        with envs.SGLANG_DEBUG_MEMORY_POOL.override(True):
            allocator = SWATokenToKVPoolAllocator(
                size=size,
                size_swa=size,
                page_size=page_size,
                dtype=dtype,
                device="cpu",
                kvcache=kv,
                need_sort=False,
            )
        is_swa, full_tokens = True, size
    elif kind == "dsa":
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

        kv = DSATokenToKVPool(
            size=size,
            page_size=page_size,
            kv_lora_rank=32,
            dtype=dtype,
            qk_rope_head_dim=16,
            layer_num=num_layers,
            device="cpu",
            index_head_dim=128,
            enable_memory_saver=False,
            kv_cache_dim=48,
        )
        allocator = PagedTokenToKVPoolAllocator(size, page_size, dtype, "cpu", kv, need_sort=False)
        is_dsa = True
    elif kind == "dsv4":
        from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator

        from kvtier_dev.harness.pools import _dsv4_device_pool

        # The real model's geometry: 256-token pages, a 128-token window, C4/C128 layers.
        kv = _dsv4_device_pool(
            page_size=page_size,
            compression_ratios=(0, 4, 128, 4)[:num_layers] or (0, 4),
            device_full_pages=pages,
            device_swa_pages=pages,
            sliding_window=window,
            dtype=torch.float8_e4m3fn,
            max_num_reqs=4,
        )
        allocator = SWATokenToKVPoolAllocator(
            size=size,
            size_swa=size,
            page_size=page_size,
            dtype=torch.float8_e4m3fn,
            device="cpu",
            kvcache=kv,
            need_sort=False,
        )
        is_swa, full_tokens = True, size
    else:
        raise ValueError(f"unknown kind {kind!r}")

    params = CacheInitParams(
        sliding_window_size=window if is_swa else None,
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
        window=window if is_swa else 0,
        linker=cache.linker.cache_linker,
    )


def tokens_for(seed: int, pages: int, page_size: int) -> List[int]:
    return [seed * 100_000 + i for i in range(pages * page_size)]


def _entry_indices(built: Built, entry: Any, slots: torch.Tensor) -> torch.Tensor:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    if entry.indices_from_pool == PoolName.SWA:
        slots = built.allocator.full_to_swa_index_mapping[slots].to(torch.int64)
    return entry.translate_indices(slots)


def _is_window_pool(entry: Any) -> bool:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    return entry.indices_from_pool == PoolName.SWA


def _page_views(built: Built, slots: torch.Tensor, window_only: bool):
    """(ptr, size) of every page component of every linker pool at ``slots``; SWA-indexed
    pools only for the trailing window when ``window_only``."""
    views = []
    for name, entry in built.linker.pools.items():
        idx = slots
        if _is_window_pool(entry):
            if window_only:
                keep = max(built.window, built.page_size) // built.page_size * built.page_size
                idx = slots[-keep:]
        ptrs, sizes = entry.get_page_buffer_meta(_entry_indices(built, entry, idx))
        views.extend((str(name), int(p), int(n)) for p, n in zip(ptrs, sizes))
    return views


def fill_slots(built: Built, slots: torch.Tensor, seed: int) -> None:
    """Write distinct bytes into every page of every linker pool at (FULL) ``slots``."""
    g = torch.Generator().manual_seed(seed)
    for _, ptr, size in _page_views(built, slots, window_only=False):
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
        ctypes.memmove(ptr, data.data_ptr(), size)


def read_slots(
    built: Built, slots: torch.Tensor, pools=None, window_only: bool = True
) -> List[bytes]:
    """The bytes of every page of every linker pool at (FULL) ``slots`` (pools indexed by SWA
    slots: their trailing window only, all a restore brings back)."""
    return [
        ctypes.string_at(ptr, size)
        for name, ptr, size in _page_views(built, slots, window_only)
        if pools is None or name in pools
    ]


def alloc(built: Built, n: int) -> torch.Tensor:
    """Page-aligned device slots (FULL and, for SWA models, mapped SWA slots), as the
    scheduler's alloc_extend does."""
    if built.kind not in ("mha_swa", "dsv4"):
        slots = built.allocator.alloc(n)
        assert slots is not None, "device pool full"
        return slots
    a = built.allocator
    full = a.full_attn_allocator.alloc(n)
    swa = a.swa_attn_allocator.alloc(n)
    assert full is not None and swa is not None, "device pool full"
    a.full_to_swa_index_mapping[full] = swa
    return full


def zero_all(built: Built) -> None:
    """Zero every device buffer the linker moves (a restore must bring the bytes back)."""
    for entry in built.linker.pools.values():
        for buf in entry.get_hybrid_pool_buffer():
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
    slots = alloc(built, len(tokens))
    fill_slots(built, slots, seed)
    insert(built, tokens, slots)
    return slots


def insert(built: Built, tokens: List[int], slots: torch.Tensor) -> None:
    """Insert computed KV at ``slots`` into the tree (each new node is offloaded)."""
    built.cache.insert(InsertParams(key=RadixKey(array("q", tokens)), value=slots.to(torch.int64)))


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
    # Seconds from ready_to_load_host_cache to the first layer's and to the last layer's
    # return from the forward's wait (the load's time to first layer and total).
    first_layer_s: float = 0.0
    total_s: float = 0.0


def page_keys(built: Built, tokens: List[int]) -> List[str]:
    """SGLang's storage hash of every page of ``tokens`` (what the tree names them by)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return list(get_storage_hash_str(RadixKey(array("q", tokens)), None, page_size=built.page_size))


def restore(
    built: Built,
    rid: str,
    tokens: List[int],
    *,
    insert_back: bool = True,
    before_load: Optional[Any] = None,
) -> Restore:
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
    if before_load is not None:
        before_load(req)
    started = time.perf_counter()
    index = cache.ready_to_load_host_cache()
    built.tp_worker.set_hicache_consumer(index)
    waits, first = [], 0.0
    for layer in range(built.num_layers):
        if layer == 1:
            first = time.perf_counter() - started
        t0 = time.perf_counter()
        if built.kind == "dsv4":
            # DeepSeek-V4's attention waits through the pool's own hook.
            built.kvcache.wait_layer_transfer(layer)
        else:
            built.kvcache.get_key_buffer(layer)
            built.kvcache.get_value_buffer(layer)
        waits.append(time.perf_counter() - t0)
    failed = cache.finish_external_linker_loads([req])
    total = time.perf_counter() - started
    first = first or total
    if insert_back and not failed:
        # The forward computed the rest: give it slots, then insert as the scheduler does.
        rest = len(tokens) - req.prefix_len
        row = req.kv.req_pool_idx
        pool = built.req_to_token_pool
        pool.write((row, slice(0, req.prefix_len)), indices.to(torch.int32))
        if rest > 0:
            extra = alloc(built, rest)
            pool.write((row, slice(req.prefix_len, len(tokens))), extra.to(torch.int32))
        req.kv.kv_committed_len = req.kv.kv_allocated_len = len(tokens)
        req.kv.cache_protected_len = match.device_prefix_len
        req.finished_reason = FINISH_LENGTH(length=0)
        cache.checkpoint_into_tree(req, up_to=len(tokens))
        cache.unlock(req.lock)
        req.lock = None
    return Restore(
        req,
        match.device_prefix_len,
        match.host_hit_length,
        loaded,
        indices,
        index,
        failed,
        waits,
        first_layer_s=first,
        total_s=total,
    )
