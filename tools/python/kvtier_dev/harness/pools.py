"""Real SGLang 0.5.23 HiCache host pools, built on CPU for kvtier's tests.

Everything returned here is a real SGLang object (device pools, host pools,
``HostPoolGroup``, ``HiCacheStorageConfig``); nothing is a mock.  The only
deviation from a GPU server is ``pin_memory=False`` / ``device="cpu"``, because
``cudaHostRegister`` cannot run without CUDA.

Run ``CUDA_VISIBLE_DEVICES= python -m kvtier_dev.harness.pools`` to print the
geometry (sizes, ``get_page_buffer_meta`` pointers/sizes,
``get_hybrid_pool_buffer()`` shapes) of every builder.

Byte sizes of one storage page (what one key's value is):

* MHA:  ``2 * page_size * layer_num * head_num * head_dim * itemsize``
  (K and V, two zero-copy components of half that size each for page layouts,
  ``2 * layer_num`` components for ``layer_first``).
* MLA:  ``page_size * layer_num * (kv_lora_rank + qk_rope_head_dim) * itemsize``
  (one component for page layouts, ``layer_num`` for ``layer_first``).
* DSV4: per pool, see ``build_dsv4_pool_group(...).specs[i].page_bytes``.
"""

from __future__ import annotations

import ctypes
import os
import zlib
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, Optional, Sequence
from unittest import mock

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

import torch  # noqa: E402

from sglang.srt.mem_cache.hicache_storage import (  # noqa: E402
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
)

__all__ = [
    "PoolSpec",
    "Dsv4PoolGroup",
    "ensure_cpu_runtime",
    "make_storage_config",
    "build_mha_device_pool",
    "build_mha_host_pool",
    "build_mla_host_pool",
    "kv_only_group",
    "build_dsv4_pool_group",
    "mha_page_bytes",
    "mla_page_bytes",
    "page_nbytes",
    "page_starts",
    "page_pattern",
    "fill_pages",
    "read_pages",
    "read_page_components",
    "zero_pages",
    "alloc_indices",
    "free_indices",
    "describe_pool",
]


# --------------------------------------------------------------------------
# Runtime config (server args) -- needed by DeepSeekV4TokenToKVPool and the
# assembler (get_memory(), get_exec(), get_spec() ...).
# --------------------------------------------------------------------------

_SERVER_ARGS_OVERRIDE = None


def ensure_cpu_runtime(**memory_overrides):
    """Publish a dummy ``ServerArgs(device="cpu")`` once per process, the way
    SGLang's own tests do (``get_context().override_server_args(...).install()``),
    then apply ``memory_overrides`` (resolved leaves such as ``hicache_ratio``,
    ``hicache_mem_layout``) with ``RuntimeContext.override``.

    Returns the published ``ServerArgs``.
    """
    global _SERVER_ARGS_OVERRIDE
    from sglang.srt.runtime_context import get_context

    ctx = get_context()
    if _SERVER_ARGS_OVERRIDE is None:
        _SERVER_ARGS_OVERRIDE = ctx.override_server_args(device="cpu")
        _SERVER_ARGS_OVERRIDE.install()
    if memory_overrides:
        ctx.override("kvtier-tests", **memory_overrides)
    return ctx.server_args


def make_storage_config(
    tp_rank: int = 0,
    tp_size: int = 1,
    is_mla: bool = False,
    model_name: Optional[str] = "test/model",
    extra_config: Optional[dict] = None,
    **kw,
) -> HiCacheStorageConfig:
    """The real ``HiCacheStorageConfig`` dataclass, filled the way
    ``HiCacheController._generate_storage_config`` fills it for a single-node,
    no-PP, no-CP server.  ``extra_config`` defaults to ``{}`` as in the
    controller (it never passes None).  ``**kw`` overrides any other field
    (``pp_rank``, ``pp_size``, ``is_page_first_layout``, ``dp_rank`` ...).
    """
    fields = dict(
        tp_rank=tp_rank,
        tp_size=tp_size,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=is_mla,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name=model_name,
        extra_config={} if extra_config is None else dict(extra_config),
    )
    fields.update(kw)
    return HiCacheStorageConfig(**fields)


# --------------------------------------------------------------------------
# MHA / MLA
# --------------------------------------------------------------------------

MHA_LAYOUTS = ("page_first", "page_first_direct", "page_head", "layer_first")
MLA_LAYOUTS = ("page_first", "page_first_direct", "layer_first")


def mha_page_bytes(page_size, layer_num, head_num, head_dim, dtype=torch.bfloat16):
    return 2 * page_size * layer_num * head_num * head_dim * dtype.itemsize


def mla_page_bytes(
    page_size, layer_num, kv_lora_rank=512, qk_rope_head_dim=64, dtype=torch.bfloat16
):
    return page_size * layer_num * (kv_lora_rank + qk_rope_head_dim) * dtype.itemsize


def build_mha_device_pool(
    *,
    page_size: int = 16,
    layer_num: int = 4,
    head_num: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    device_pages: int = 4,
):
    """Real CPU ``MHATokenToKVPool`` (the device pool a host pool mirrors)."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(
        size=device_pages * page_size,
        page_size=page_size,
        dtype=dtype,
        head_num=head_num,
        head_dim=head_dim,
        layer_num=layer_num,
        device="cpu",
        enable_memory_saver=False,
        enable_alt_stream=False,
    )


def build_mha_host_pool(
    layout: str = "page_first",
    page_size: int = 16,
    layer_num: int = 4,
    head_num: int = 2,
    head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    size_pages: int = 64,
    device_pages: int = 4,
    allocator_type: str = "default",
):
    """Real ``MHATokenToKVPoolHost`` over a real CPU ``MHATokenToKVPool``.

    ``allocator_type`` is passed where SGLang takes it: ``"shm"`` allocates the host buffers
    with SGLang's own ``ShmHostTensorAllocator`` (memfds, kept on ``host.allocator``), as
    ``"allocator": "shm"`` in the storage extra_config does on a real server.

    Built like ``hybrid_pool_assembler._build_mha_mla_host_pool`` (which uses
    ``_mha_host_inputs``) but with ``pin_memory=False`` and an exact host
    capacity of ``size_pages`` pages.  The device pool is kept on the host
    object as ``host_pool.kvtier_device_pool`` for callers that need it.
    Default geometry: 16 tok x 4 layers x 2 heads x 64 dim bf16 = 32 KiB/page
    (2 x 16 KiB components).  For >= 256 KiB pages use e.g. page_size=64,
    layer_num=8, head_num=4, head_dim=64 (512 KiB/page, 2 x 256 KiB).
    """
    if layout not in MHA_LAYOUTS:
        raise ValueError(f"unsupported MHA layout {layout!r}; use one of {MHA_LAYOUTS}")
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        _mha_host_inputs,
    )

    device_pool = build_mha_device_pool(
        page_size=page_size,
        layer_num=layer_num,
        head_num=head_num,
        head_dim=head_dim,
        dtype=dtype,
        device_pages=device_pages,
    )
    host_cls, buffer_info, host_kwargs = _mha_host_inputs(device_pool)
    host = host_cls(
        buffer_info,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=page_size,
        layout=layout,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator_type,
        pool_label="kv",
        host_token_capacity=size_pages * page_size,
        **host_kwargs,
    )
    host.kvtier_device_pool = device_pool
    return host


def build_mla_host_pool(
    layout: str = "page_first",
    page_size: int = 16,
    layer_num: int = 4,
    kv_lora_rank: int = 512,
    qk_rope_head_dim: int = 64,
    dtype: torch.dtype = torch.bfloat16,
    size_pages: int = 64,
    device_pages: int = 4,
    allocator_type: str = "default",
):
    """Real ``MLATokenToKVPoolHost`` over a real CPU ``MLATokenToKVPool``,
    constructed like ``_build_mha_mla_host_pool`` with ``pin_memory=False``.
    ``allocator_type="shm"``: SGLang's memfd allocator (see ``build_mha_host_pool``).
    Default geometry: 16 tok x 4 layers x 576 bf16 = 72 KiB/page."""
    if layout not in MLA_LAYOUTS:
        raise ValueError(f"unsupported MLA layout {layout!r}; use one of {MLA_LAYOUTS}")
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    device_pool = MLATokenToKVPool(
        size=device_pages * page_size,
        page_size=page_size,
        dtype=dtype,
        kv_lora_rank=kv_lora_rank,
        qk_rope_head_dim=qk_rope_head_dim,
        layer_num=layer_num,
        device="cpu",
        enable_memory_saver=False,
    )
    host = MLATokenToKVPoolHost(
        device_pool.get_device_pool_infos()[0].buffer_info,
        host_to_device_ratio=2.0,
        host_size=0,
        page_size=page_size,
        layout=layout,
        pin_memory=False,
        device="cpu",
        allocator_type=allocator_type,
        override_kv_cache_dim=device_pool.kv_cache_dim,
        device_capacity_tokens=(
            device_pool.size
            if device_pool.host_capacity_tokens is None
            else device_pool.host_capacity_tokens
        ),
        start_layer=device_pool.start_layer,
        end_layer=device_pool.end_layer,
        target_layer_num=device_pool.layer_num,
        pool_label="kv",
        host_token_capacity=size_pages * page_size,
    )
    host.kvtier_device_pool = device_pool
    return host


def kv_only_group(host_pool, device_pool=None):
    """Anchor-only ``HostPoolGroup`` as ``build_kv_only_group`` makes it: in
    0.5.23 every plain MHA/MLA model also runs the ``HybridCacheController``
    over such a group (so the backend also gets
    ``register_mem_host_pool_v2(host_pool, PoolName.KV)``)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (
        build_pool_entry,
    )
    from sglang.srt.mem_cache.pool_host import HostPoolGroup

    if device_pool is None:
        device_pool = getattr(host_pool, "kvtier_device_pool", None)
    layer_num = getattr(host_pool, "layer_num", 0)
    return HostPoolGroup(
        [
            build_pool_entry(
                name=PoolName.KV,
                host_pool=host_pool,
                device_pool=device_pool,
                layer_mapping={i: i for i in range(layer_num)},
                transfer_layer_id_max=layer_num,
                is_anchor=True,
            )
        ]
    )


# --------------------------------------------------------------------------
# DeepSeek-V4
# --------------------------------------------------------------------------


@dataclass
class PoolSpec:
    """One entry of a host pool group, as the radix cache / controller sees it."""

    name: PoolName
    host_pool: Any
    hit_policy: PoolHitPolicy
    # None: the pool has its own host indices (KV anchor, SWA); KV / SWA: the
    # controller reuses that pool's indices and keys (sidecar).
    indices_from_pool: Optional[PoolName]
    page_size: int
    # TRAILING_PAGES only: how many trailing pages a prefetch asks for
    # (``SWAComponent.full_window_pages``).  None for ALL_PAGES pools.
    window_pages: Optional[int]
    page_bytes: int
    is_anchor: bool = False

    @property
    def is_trailing(self) -> bool:
        return self.hit_policy == PoolHitPolicy.TRAILING_PAGES

    @property
    def is_sidecar(self) -> bool:
        return self.indices_from_pool is not None


@dataclass
class Dsv4PoolGroup:
    group: Any  # real HostPoolGroup
    # Anchor first, then the aux transfers in the order the radix cache emits
    # them: component pools (SWA) then sidecars in _DeepSeekV4Strategy order.
    specs: list[PoolSpec]
    device_pool: Any  # real DeepSeekV4TokenToKVPool
    sidecars: list  # real SidecarPoolSpec list from _DeepSeekV4Strategy.build
    page_size: int
    window_pages: int
    full_host_pages: int
    swa_host_pages: int
    controller_kwargs: dict = field(default_factory=dict)

    @property
    def anchor(self):
        return self.group.anchor_entry.host_pool

    def spec(self, name) -> PoolSpec:
        for s in self.specs:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def side_specs(self) -> list[PoolSpec]:
        return [s for s in self.specs if not s.is_anchor]


def _dsv4_device_pool(
    *,
    page_size: int,
    compression_ratios: Sequence[int],
    device_full_pages: int,
    device_swa_pages: int,
    sliding_window: int,
    dtype: torch.dtype,
    max_num_reqs: int,
):
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import (
        DeepSeekV4TokenToKVPool,
        resolve_compress_state_ring_size,
    )

    full = device_full_pages * page_size
    swa = device_swa_pages * page_size
    # Sized as pool_configurator._compute_dsv4_sizes does.
    return DeepSeekV4TokenToKVPool(
        max_num_reqs=max_num_reqs,
        swa_size=swa,
        c4_size=full // 4,
        c128_size=full // 128,
        c4_state_pool_size=swa // page_size * resolve_compress_state_ring_size(4),
        c128_state_pool_size=0,
        page_size=page_size,
        swa_page_size=page_size,
        dtype=dtype,
        c4_state_dtype=torch.float32,
        c128_state_dtype=torch.float32,
        qk_nope_head_dim=448,
        qk_rope_head_dim=64,
        indexer_head_dim=128,
        layer_num=len(compression_ratios),
        device="cpu",
        enable_memory_saver=False,
        compression_ratios=list(compression_ratios),
        sliding_window=sliding_window,
        # end-exclusive, as model_runner's layer_info passes them; the KVCache
        # default (end_layer = layer_num - 1) breaks the assembler's
        # transfer_layer_id_max = end_layer - start_layer.
        start_layer=0,
        end_layer=len(compression_ratios),
        full_size=full,
    )


def build_dsv4_pool_group(
    layout: str = "page_first",
    *,
    page_size: int = 256,
    compression_ratios: Sequence[int] = (0, 4, 128, 4),
    device_full_pages: int = 8,
    device_swa_pages: int = 4,
    hicache_ratio: float = 2.0,
    sliding_window: int = 128,
    dtype: torch.dtype = torch.float8_e4m3fn,
    window_pages: Optional[int] = None,
    max_num_reqs: int = 4,
) -> Dsv4PoolGroup:
    """DeepSeek-V4 host pool group, assembled by SGLang's own code.

    Runs the real ``_DeepSeekV4Strategy().build`` (and thus the real
    ``build_deepseek_v4_hicache_stack`` / ``build_pool_entry``) over a real CPU
    ``DeepSeekV4TokenToKVPool`` with three substitutions in the assembler
    module only: ``DeepSeekV4PagedHostPool`` / ``DeepSeekV4StateHostPool`` are
    wrapped so every instance gets ``pin_memory=False`` (the assembler
    hard-codes the default ``True``), and ``HybridCacheController`` is replaced
    by a recorder (the real one starts threads and torch.distributed groups;
    kvtier_dev.harness.flows builds its own).  The pools produced are the real classes.

    Host page counts follow ``_deepseek_v4_num_host_pages``: FULL/C4/C128 pools
    get ``device_full_pages * hicache_ratio`` pages, SWA and the C4 state pools
    ``device_swa_pages * hicache_ratio``.

    ``window_pages`` is the SWA trailing window a prefetch asks for; it
    defaults to ``SWAComponent.full_window_pages = ceil(sliding_window /
    page_size)`` (1 for the real model: 128-token window, 256-token pages).
    """
    ensure_cpu_runtime(hicache_ratio=float(hicache_ratio), hicache_mem_layout=layout)
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as asm
    from sglang.srt.mem_cache.memory_pool_host import (
        DeepSeekV4PagedHostPool,
        DeepSeekV4StateHostPool,
    )
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    kvcache = _dsv4_device_pool(
        page_size=page_size,
        compression_ratios=compression_ratios,
        device_full_pages=device_full_pages,
        device_swa_pages=device_swa_pages,
        sliding_window=sliding_window,
        dtype=dtype,
        max_num_reqs=max_num_reqs,
    )

    def paged_host_pool(*args, **kwargs):
        kwargs["pin_memory"] = False
        return DeepSeekV4PagedHostPool(*args, **kwargs)

    def state_host_pool(*args, **kwargs):
        kwargs["pin_memory"] = False
        return DeepSeekV4StateHostPool(*args, **kwargs)

    recorded: dict = {}

    def controller_recorder(*args, **kwargs):
        recorded["args"] = args
        recorded["kwargs"] = kwargs
        return None

    swa_alloc = SimpleNamespace(alloc=lambda n: None, free=lambda idx: None)
    params = SimpleNamespace(
        page_size=page_size,
        token_to_kv_pool_allocator=SimpleNamespace(
            size_full=device_full_pages * page_size, swa_attn_allocator=swa_alloc
        ),
        mtp_draft_device_pools=(),
        tp_cache_group=None,
        attn_cp_cache_group=None,
        attn_tp_cache_group=None,
        pp_cache_group=None,
    )
    cache = SimpleNamespace(
        components={ComponentType.FULL, ComponentType.SWA},
        evict_host=lambda n, ct: 0,
    )
    with (
        mock.patch.object(asm, "DeepSeekV4PagedHostPool", paged_host_pool),
        mock.patch.object(asm, "DeepSeekV4StateHostPool", state_host_pool),
        mock.patch.object(asm, "HybridCacheController", controller_recorder),
    ):
        result = asm._DeepSeekV4Strategy().build(
            cache=cache,
            kvcache=kvcache,
            params=params,
            server_args=None,
            load_cache_event=None,
        )
    group = result.host_pool_group
    if window_pages is None:
        window_pages = (sliding_window + page_size - 1) // page_size

    entry_map = group.entry_map
    specs = [
        PoolSpec(
            name=PoolName.KV,
            host_pool=group.anchor_entry.host_pool,
            hit_policy=PoolHitPolicy.ALL_PAGES,
            indices_from_pool=None,
            page_size=group.anchor_entry.host_pool.page_size,
            window_pages=None,
            page_bytes=0,
            is_anchor=True,
        )
    ]
    if PoolName.SWA in entry_map:
        swa_pool = entry_map[PoolName.SWA].host_pool
        specs.append(
            PoolSpec(
                name=PoolName.SWA,
                host_pool=swa_pool,
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
                indices_from_pool=None,
                page_size=swa_pool.page_size,
                window_pages=window_pages,
                page_bytes=page_nbytes(swa_pool),
            )
        )
    for sc in result.sidecars:
        pool = entry_map[sc.pool_name].host_pool
        trailing = sc.hit_policy == PoolHitPolicy.TRAILING_PAGES
        specs.append(
            PoolSpec(
                name=sc.pool_name,
                host_pool=pool,
                hit_policy=sc.hit_policy,
                indices_from_pool=sc.indices_from_pool,
                page_size=pool.page_size,
                window_pages=window_pages if trailing else None,
                page_bytes=page_nbytes(pool),
            )
        )
    listed = {s.name for s in specs}
    missing = [e.name for e in group.entries if e.name not in listed]
    if missing:
        raise AssertionError(f"group entries without a spec: {missing}")
    return Dsv4PoolGroup(
        group=group,
        specs=specs,
        device_pool=kvcache,
        sidecars=list(result.sidecars),
        page_size=page_size,
        window_pages=window_pages,
        full_host_pages=group.anchor_entry.host_pool.size // page_size,
        swa_host_pages=(
            entry_map[PoolName.SWA].host_pool.size // page_size if PoolName.SWA in entry_map else 0
        ),
        controller_kwargs=recorded.get("kwargs", {}),
    )


# --------------------------------------------------------------------------
# Page helpers
# --------------------------------------------------------------------------


def _pool_tag(host_pool) -> str:
    return str(getattr(host_pool, "pool_name", None) or type(host_pool).__name__)


def page_nbytes(host_pool) -> int:
    """Bytes of one storage page (= ``get_dummy_flat_data_page()`` bytes)."""
    page = host_pool.get_dummy_flat_data_page()
    return page.numel() * page.element_size()


def page_starts(host_pool, host_indices: torch.Tensor) -> list[int]:
    """First token index of every page in ``host_indices`` (what the
    controller passes to ``get_data_page`` / ``set_from_flat_data_page``)."""
    ps = host_pool.page_size
    if host_indices.numel() % ps:
        raise ValueError(
            f"{host_indices.numel()} indices is not a whole number of {ps}-token pages"
        )
    return [int(x) for x in host_indices[::ps].tolist()]


def page_pattern(host_pool, seed: int, ordinal: int) -> bytes:
    """Deterministic pseudo-random bytes of page ``ordinal`` for ``seed``; the
    pool's name is mixed in so pools of one group never share bytes."""
    n = page_nbytes(host_pool)
    if n == 0:
        return b""
    mix = zlib.crc32(f"{_pool_tag(host_pool)}/{seed}/{ordinal}".encode())
    g = torch.Generator().manual_seed(mix)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes()


def _bytes_to_page(host_pool, data: bytes) -> torch.Tensor:
    dummy = host_pool.get_dummy_flat_data_page()
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return raw.view(dummy.dtype)


def fill_pages(host_pool, host_indices: torch.Tensor, seed: int) -> list[bytes]:
    """Write ``page_pattern(pool, seed, i)`` into the i-th page of
    ``host_indices`` through the pool's own ``set_from_flat_data_page`` (which
    writes that page in every physical buffer of the pool and nothing else).
    Returns the bytes written per page (``b""`` for a logical anchor)."""
    written = []
    for i, start in enumerate(page_starts(host_pool, host_indices)):
        data = page_pattern(host_pool, seed, i)
        if data:
            host_pool.set_from_flat_data_page(start, _bytes_to_page(host_pool, data))
        written.append(data)
    return written


def zero_pages(host_pool, host_indices: torch.Tensor) -> None:
    for start in page_starts(host_pool, host_indices):
        dummy = host_pool.get_dummy_flat_data_page()
        if dummy.numel():
            host_pool.set_from_flat_data_page(start, torch.zeros_like(dummy))


def read_pages(host_pool, host_indices: torch.Tensor) -> list[bytes]:
    """Per page, all components, via ``get_data_page(start, flat=True)`` (the
    same bytes the controller's legacy ``batch_set`` path hands a backend)."""
    out = []
    for start in page_starts(host_pool, host_indices):
        page = host_pool.get_data_page(start, flat=True).contiguous()
        out.append(page.view(torch.uint8).numpy().tobytes() if page.numel() else b"")
    return out


def read_page_components(host_pool, host_indices: torch.Tensor) -> list[list[bytes]]:
    """Per page, the raw bytes at each ``get_page_buffer_meta`` (ptr, size)
    -- what a zero-copy (v1 / v2) backend reads.  [] pages for a logical
    anchor (meta is None)."""
    ps = host_pool.page_size
    out = []
    for start in page_starts(host_pool, host_indices):
        meta = host_pool.get_page_buffer_meta(torch.arange(start, start + ps, dtype=torch.int64))
        if meta is None:
            out.append([])
            continue
        ptrs, sizes = meta
        out.append([ctypes.string_at(p, s) for p, s in zip(ptrs, sizes)])
    return out


def alloc_indices(host_pool, n_pages: int) -> torch.Tensor:
    """Host token indices for ``n_pages`` pages from the pool's real allocator
    (``page_size`` consecutive, page-aligned token indices per page, as the
    controller passes them).  Works for a ``HostPoolGroup`` (anchor).  A
    ``DeepSeekV4StateHostPool`` has no allocator (it reuses SWA indices):
    allocate from the SWA pool instead."""
    idx = host_pool.alloc(n_pages * host_pool.page_size)
    if idx is None:
        raise RuntimeError(
            f"{_pool_tag(host_pool)}: cannot allocate {n_pages} pages "
            f"({host_pool.available_size()} tokens free)"
        )
    return idx


def free_indices(host_pool, host_indices: torch.Tensor) -> None:
    host_pool.free(host_indices)


def describe_pool(host_pool, n_pages: int = 2) -> dict:
    """Geometry of a host pool, for by-hand verification."""
    ps = host_pool.page_size
    idx = torch.arange(0, n_pages * ps, dtype=torch.int64)
    meta = host_pool.get_page_buffer_meta(idx)
    buffers = (
        host_pool.get_hybrid_pool_buffer() if hasattr(host_pool, "get_hybrid_pool_buffer") else None
    )
    kv = getattr(host_pool, "kv_buffer", None)
    return dict(
        cls=type(host_pool).__name__,
        name=_pool_tag(host_pool),
        layout=getattr(host_pool, "layout", None),
        page_size=ps,
        size_tokens=host_pool.size,
        pages=host_pool.size // ps,
        page_bytes=page_nbytes(host_pool),
        kv_buffer=(
            None
            if kv is None
            else [tuple(b.shape) for b in kv]
            if isinstance(kv, list)
            else tuple(kv.shape)
        ),
        hybrid_pool_buffer=(
            None
            if buffers is None
            else [(tuple(b.shape), str(b.dtype), b.data_ptr()) for b in buffers]
        ),
        meta_first_pages=(
            None if meta is None else dict(n_ptrs=len(meta[0]), ptrs=meta[0], sizes=meta[1])
        ),
    )


def _print_description(title, host_pool):
    d = describe_pool(host_pool)
    print(f"== {title}")
    for k, v in d.items():
        print(f"   {k}: {v}")


if __name__ == "__main__":  # pragma: no cover - by-hand verification
    for layout in MHA_LAYOUTS:
        _print_description(f"MHA {layout}", build_mha_host_pool(layout, size_pages=8))
    _print_description(
        "MHA page_first 512 KiB pages",
        build_mha_host_pool(
            "page_first", page_size=64, layer_num=8, head_num=4, head_dim=64, size_pages=8
        ),
    )
    for layout in MLA_LAYOUTS:
        _print_description(f"MLA {layout}", build_mla_host_pool(layout, size_pages=8))
    for layout in ("page_first", "layer_first"):
        stack = build_dsv4_pool_group(layout)
        print(
            f"#### DSV4 {layout}: window_pages={stack.window_pages} "
            f"full_host_pages={stack.full_host_pages} swa_host_pages={stack.swa_host_pages}"
        )
        for s in stack.specs:
            print(
                f"   spec {s.name.value}: {type(s.host_pool).__name__} "
                f"policy={s.hit_policy.value} from={s.indices_from_pool} "
                f"page_size={s.page_size} window={s.window_pages} page_bytes={s.page_bytes}"
            )
        for s in stack.specs:
            _print_description(f"DSV4 {layout} {s.name.value}", s.host_pool)
