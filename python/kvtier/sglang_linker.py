"""kvtier as SGLang's direct L3: a ``UnifiedCacheLinker`` (issue 18).

Enable it with::

    --enable-unified-cache-external-linker
    --unified-cache-external-linker-backend dynamic
    --unified-cache-external-linker-config '{"linker": "KvtierLinker",
        "linker_module_path": "kvtier.sglang_linker",
        "linker_extra_config": {"dram_capacity_bytes": "32GiB"}}'

What this module owns: the *pool view* (which device buffers make up which stored object of a
page, and which of their bytes belong to which transfer layer), SGLang's
``LayerWiseLoadCounter`` and the offload ready events. Everything that moves or looks up bytes
is native (``kvtier._native.LinkerCore`` and the store's ``exists_v2``): loads run layer by
layer on a kvtier thread, each layer marked complete only after its bytes landed, natively
(``NativeLayerCounter``: no GIL between the copy and the forward's wait); offloads check which
objects exist first, so re-offloading a loaded tail costs an existence check, not a copy, and
their results come back in call order.

Pool views: DeepSeek-V4, DSA and Mamba(+SWA) come from SGLang's own resolver
(``resolve_hybrid_device_pool_group``). Plain MHA, MLA and MHA+SWA, which SGLang 0.5.23's
resolver refuses, get kvtier's own view: one object per page and component (``k`` and ``v`` for
MHA, ``kv`` for MLA), each the page's rows of every layer in layer order. Those are the bytes
and the keys of the HiCache adapter (``kvtier.sglang.KvtierStore``) with the
``page_first_direct`` host layout, so the same store serves both: a page offloaded here is a
HiCache hit and the other way round. MLA pages carry no TP rank (written once across TP, by the
storage writer rank, except in embedded mode where every process has its own store).

Keys are composed only in :meth:`KvtierLinker._suffixes` and :meth:`KvtierLinker._key`,
through the HiCache adapter's :class:`kvtier.sglang_keys.KeyLayout`
(``KvtierStore.key_layout``), and hit policies are translated by
:func:`kvtier.sglang_keys.pool_query`, so the linker and the adapter compose the same keys and
give the same verdicts.

Device memory: CPU device pools are registered with kvtier and copied directly. Accelerator
pools go through ``kvtier.sglang_linker_staging`` (pinned staging, torch copies on a side
stream); that path was tested on CPU pools only.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorageConfig,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.hybrid_cache.linker_pool_assembler import (
    DevicePoolEntry,
    DevicePoolGroup,
    resolve_hybrid_device_pool_group,
)
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import (
    LayerWiseLoadCounter,
    UnifiedCacheLinker,
)

from kvtier import _native
from kvtier.sglang import KvtierStore
from kvtier.sglang_keys import pool_query

logger = logging.getLogger(__name__)

# Host pool twins for kvtier's own views: the HiCache adapter's fingerprint names the host pool
# class and layout, so the linker's objects are keyed as that pool's pages would be.
_TWIN_LAYOUT = "page_first_direct"


def _host_twin(class_name: str, device_pool: Any, page_size: int) -> Any:
    twin_cls = type(class_name, (), {})
    twin = twin_cls()
    twin.layout = _TWIN_LAYOUT
    twin.dtype = device_pool.dtype
    twin.page_size = page_size
    twin.storage_format_tag = None
    return twin


@dataclass
class _Object:
    """One stored object per page of a pool entry: pieces of device rows, in object order."""

    suffix: str
    # (base_ptr, row_stride, size) of each piece, in object order.
    pieces: List[Tuple[int, int, int]]
    # Byte offset of each piece inside the object.
    offsets: List[int]
    # transfer layer -> indices into pieces.
    layer_pieces: Dict[int, List[int]] = field(default_factory=dict)

    @property
    def total(self) -> int:
        return sum(size for _, _, size in self.pieces)


def _entry_objects(
    entry: DevicePoolEntry,
) -> List[Tuple[List[Tuple[int, int, int]], Dict[int, List[int]]]]:
    """An entry's objects: every component in one object when packed, else one per component.
    Returns, per object, its pieces and the pieces of each transfer layer."""
    groups = (
        [list(range(len(entry.buffer_meta)))]
        if entry.packed
        else [[c] for c in range(len(entry.buffer_meta))]
    )
    objects = []
    for comps in groups:
        pieces, layer_pieces = [], {}
        for c in comps:
            base = len(pieces)
            pieces.extend(entry.buffer_meta[c])
            for layer, mapped in entry.layer_mapping.items():
                idx = [mapped] if isinstance(mapped, int) else list(mapped)
                layer_pieces.setdefault(layer, []).extend(base + i for i in idx)
        objects.append((pieces, layer_pieces))
    return objects


def _own_entry(name, pool, buffers_by_component, layer_mapping, page_size) -> DevicePoolEntry:
    return DevicePoolEntry(
        name=name,
        indices_from_pool=name,
        device_pool=pool,
        components=buffers_by_component,
        layer_mapping=layer_mapping,
        page_size=page_size,
        rows_are_pages=False,
        packed=False,
    )


def _own_pool_group(kvcache: Any, page_size: int):
    """kvtier's view for the pools SGLang's resolver refuses: (group, twins by pool name).
    None when the pool is none of plain MHA, MLA or MHA+SWA."""
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    def mha_ok(pool) -> bool:
        return (
            isinstance(pool, MHATokenToKVPool)
            and getattr(pool, "k_scale_buffer", None) is None
            and getattr(pool, "native_k_scale_buffer", None) is None
        )

    start = getattr(kvcache, "start_layer", 0) or 0
    if type(kvcache) is SWAKVPool and mha_ok(kvcache.full_kv_pool) and mha_ok(kvcache.swa_kv_pool):
        full = {g - start: lid for g, (lid, swa) in kvcache.layers_mapping.items() if not swa}
        swa = {g - start: lid for g, (lid, swa) in kvcache.layers_mapping.items() if swa}
        entries = [
            _own_entry(
                PoolName.KV,
                kvcache.full_kv_pool,
                [list(kvcache.full_kv_pool.k_buffer), list(kvcache.full_kv_pool.v_buffer)],
                full,
                page_size,
            ),
            _own_entry(
                PoolName.SWA,
                kvcache.swa_kv_pool,
                [list(kvcache.swa_kv_pool.k_buffer), list(kvcache.swa_kv_pool.v_buffer)],
                swa,
                page_size,
            ),
        ]
        twins = {
            PoolName.KV: _host_twin("MHATokenToKVPoolHost", kvcache.full_kv_pool, page_size),
            PoolName.SWA: _host_twin("MHATokenToKVPoolHost", kvcache.swa_kv_pool, page_size),
        }
        layers = max([*full, *swa]) + 1
        return DevicePoolGroup(entries, layers, page_size), twins
    if type(kvcache) is MHATokenToKVPool or (
        mha_ok(kvcache) and type(kvcache).__name__ == "MHATokenToKVPool"
    ):
        n = len(kvcache.k_buffer)
        entry = _own_entry(
            PoolName.KV,
            kvcache,
            [list(kvcache.k_buffer), list(kvcache.v_buffer)],
            {layer: layer for layer in range(n)},
            page_size,
        )
        twins = {PoolName.KV: _host_twin("MHATokenToKVPoolHost", kvcache, page_size)}
        return DevicePoolGroup([entry], n, page_size), twins
    if type(kvcache) is MLATokenToKVPool:
        n = len(kvcache.kv_buffer)
        entry = _own_entry(
            PoolName.KV,
            kvcache,
            [list(kvcache.kv_buffer)],
            {layer: layer for layer in range(n)},
            page_size,
        )
        twins = {PoolName.KV: _host_twin("MLATokenToKVPoolHost", kvcache, page_size)}
        return DevicePoolGroup([entry], n, page_size, rank_replicated=True), twins
    return None


class NativeLayerCounter(LayerWiseLoadCounter):
    """SGLang's ``LayerWiseLoadCounter`` whose layers are completed natively: kvtier's load
    thread records each landed layer in ``LinkerCore`` without taking the GIL, and the
    forward's ``wait_until`` blocks there with the GIL released. Failures reach SGLang the
    same way (``finish`` returns False)."""

    def __init__(self, num_layers: int, core: Any, on_layer_ready=None):
        super().__init__(num_layers, on_layer_ready)
        self._core = core

    def update_producer(self) -> int:
        self.producer_index += 1
        self._core.open_batch(self.producer_index, self.num_layers)
        return self.producer_index

    def complete(self, index: int, layer: int) -> None:  # layers complete natively
        return None

    def fail(self, index: int, error: BaseException) -> None:
        self._core.fail_batch(index, str(error))

    def wait_until(self, threshold: int) -> None:
        index = self.consumer_index
        if index < 0:
            return
        self._core.wait_layer(index, threshold)
        if self.on_layer_ready is not None:
            self.on_layer_ready(index, threshold)

    def finish(self, index: int) -> bool:
        return self._core.finish_batch(index)

    def reset(self) -> None:
        super().reset()
        self._core.reset_batches()


def _pool_key(name: Any) -> str:
    return str(name.value if isinstance(name, PoolName) else name)


class KvtierLinker(UnifiedCacheLinker):
    """SGLang's direct-L3 linker on a kvtier store (see the module docs)."""

    # kvtier copies straight into the device pools (CPU pools); the staging subclass does not.
    direct_device_access = True

    def __init__(
        self,
        server_args: Any,
        params: Any,
        *,
        components: Any,
        extra_config: Optional[dict] = None,
        forward_stream: Any = None,
    ):
        self.forward_stream = forward_stream
        self.page_size = int(params.page_size)
        kvcache = params.token_to_kv_pool_allocator.get_kvcache()
        self._twins: Dict[Any, Any] = {}
        try:
            self.pool_group = resolve_hybrid_device_pool_group(
                kvcache=kvcache, page_size=self.page_size, params=params, components=components
            )
            self.view = "sglang"
        except ValueError as refused:
            own = _own_pool_group(kvcache, self.page_size)
            if own is None:
                raise
            self.pool_group, self._twins = own
            self.view = "kvtier"
            logger.info(
                "kvtier linker: SGLang's resolver refused this pool (%s); using kvtier's own view",
                refused,
            )
        self.pools = self.pool_group.entry_map
        self.num_layers = int(self.pool_group.num_layers)
        if self.direct_device_access and any(
            b.device.type != "cpu" for e in self.pools.values() for b in e.get_hybrid_pool_buffer()
        ):
            raise ValueError(
                "kvtier.sglang_linker.KvtierLinker moves CPU device pools; for accelerator pools "
                "use kvtier.sglang_linker_staging.KvtierStagingLinker"
            )

        tp_rank, tp_size = 0, 1
        tp_group = getattr(params, "attn_tp_cache_group", None) or getattr(
            params, "tp_cache_group", None
        )
        if (
            torch.distributed.is_available()
            and torch.distributed.is_initialized()
            and tp_group is not None
        ):
            tp_rank = torch.distributed.get_rank(group=tp_group)
            tp_size = torch.distributed.get_world_size(group=tp_group)
        replicated = bool(self.pool_group.rank_replicated)
        model_path = getattr(server_args, "model_path", None)
        config = HiCacheStorageConfig(
            tp_rank=tp_rank,
            tp_size=tp_size,
            pp_rank=int(getattr(params, "pp_rank", 0) or 0),
            pp_size=int(getattr(params, "pp_size", 1) or 1),
            attn_cp_rank=int(getattr(params, "attn_cp_rank", 0) or 0),
            attn_cp_size=int(getattr(params, "attn_cp_size", 1) or 1),
            is_mla_model=replicated,
            enable_storage_metrics=False,
            is_page_first_layout=True,
            model_name=model_path,
            extra_config=dict(extra_config or {}),
        )
        # The HiCache adapter opens the store and gathers the key layout (kvtier.sglang_keys);
        # the linker borrows both through their public faces.
        self.store = KvtierStore(config)
        self.key_layout = self.store.key_layout
        self._native = self.store.native
        self._prefix = self.key_layout.prefix
        # Rank-replicated objects are written by one rank, unless this store is private.
        self._writes_replicated = self.store.writes_replicated_kv
        self._replicated = replicated
        self._objects: Dict[str, List[_Object]] = {
            _pool_key(name): self._suffixes(name, entry) for name, entry in self.pools.items()
        }
        self._regions = self._register_buffers()

        self.core = _native.LinkerCore(self._native)
        self.layer_done_counter = self._make_counter()
        if PoolName.MAMBA in self.pools:
            params.req_to_token_pool.register_layer_transfer_counter(self.layer_done_counter)
        self.pending_loads: Dict[str, List[PoolTransfer]] = {}
        self._lock = threading.Lock()
        self._closed = False
        logger.info(
            "kvtier linker: %s view, pools %s, %d layers, store mode %s",
            self.view,
            {k: [o.suffix for o in v] for k, v in self._objects.items()},
            self.num_layers,
            self._native.mode,
        )

    # ------------------------------------------------------------------ keys (one place)
    def _suffixes(self, name: Any, entry: DevicePoolEntry) -> List[_Object]:
        """The objects of one page of ``entry`` and their key suffixes, via the key layout."""
        layout = self.key_layout
        objects = _entry_objects(entry)
        sizes = [sum(size for _, _, size in pieces) for pieces, _ in objects]
        twin = self._twins.get(name)
        if twin is not None:
            # Same name, pool identity and component names as the HiCache adapter's pool.
            is_anchor = name == PoolName.KV
            replicated = self._replicated if is_anchor else bool(self._replicated)
            pool_name = PoolName.KV.value if is_anchor else _pool_key(name)
            base = None if is_anchor else pool_name
            fp = layout.fingerprint(pool_name, twin, sizes, replicated, "zero-copy")
            names = layout.component_names(base, len(objects))
        else:
            replicated = self._replicated and name != PoolName.MAMBA
            fp = layout.fingerprint(_pool_key(name), entry.device_pool, sizes, replicated, "linker")
            names = layout.component_names(_pool_key(name), len(objects))
        tag = layout.rank_tag(replicated)
        out = []
        for (pieces, layer_pieces), component in zip(objects, names):
            offsets, at = [], 0
            for _, _, size in pieces:
                offsets.append(at)
                at += size
            out.append(_Object(layout.suffix(fp, tag, component), pieces, offsets, layer_pieces))
        return out

    def _key(self, page_key: str, obj: _Object) -> str:
        return self.key_layout.key(page_key, obj.suffix)

    # ------------------------------------------------------------------ memory
    def _register_buffers(self) -> List[int]:
        seen, ids = set(), []
        for name, entry in self.pools.items():
            for buffer in entry.get_hybrid_pool_buffer():
                storage = buffer.untyped_storage()
                allocation = (int(storage.data_ptr()), int(storage.nbytes()))
                if allocation in seen or allocation[1] == 0:
                    continue
                seen.add(allocation)
                ids.append(self._native.register_region(*allocation, f"linker:{_pool_key(name)}"))
        return ids

    def _writes(self, name: Any) -> bool:
        entry_replicated = self._replicated and name != PoolName.MAMBA
        return self._writes_replicated or not entry_replicated

    # ------------------------------------------------------------------ lookup
    def lookup(self, rid: str, transfers: List[PoolTransfer]) -> List[int]:
        try:
            expanded = self.pool_group.resolve_transfers(transfers)
            kv = next((t for t in transfers if t.name == PoolName.KV), None)
            if not expanded or kv is None or not kv.keys:
                return []
            anchor = None
            pools = []
            for t in expanded:
                suffixes = [o.suffix for o in self._objects[_pool_key(t.name)]]
                if t.name == PoolName.KV:
                    anchor = suffixes
                    continue
                query, problem = pool_query(
                    _pool_key(t.name),
                    t.hit_policy,
                    suffixes,
                    t.keys,
                    getattr(t, "group_pages", None),
                )
                if problem:
                    logger.error("kvtier linker lookup: %s", problem)
                pools.append(query)
            _, _, restorable = self._native.exists_v2(self._prefix, list(kv.keys), anchor, pools)
            return list(restorable)
        except Exception:
            logger.exception("kvtier linker lookup failed; reporting a miss")
            return []

    # ------------------------------------------------------------------ load
    def load(self, rid: str, transfers: List[PoolTransfer]) -> bool:
        expanded = self.pool_group.resolve_transfers(
            transfers, allow_partial=True, allow_missing_kv=True
        )
        if not expanded:
            return False
        if rid in self.pending_loads:
            raise RuntimeError(f"kvtier linker: a load for rid={rid} is already queued")
        self.pending_loads[rid] = expanded
        return True

    def cancel_queued_load(self, rid: str) -> bool:
        return self.pending_loads.pop(rid, None) is not None

    def _load_plan(self, request_transfers: Sequence[List[PoolTransfer]]):
        """The batch for LinkerCore.submit_load: one ``(key, object_len, row, shape)`` per
        object of every page, and per shape (object kind of a pool) the pieces of each layer.
        Built in O(pages x objects); the per-layer addresses are computed natively."""
        shape_ids: Dict[Tuple[str, int], int] = {}
        shapes: List[List[List[Tuple[int, int, int, int]]]] = []
        objects: List[Tuple[str, int, int, int]] = []
        for transfers in request_transfers:
            for t in transfers:
                name = _pool_key(t.name)
                entry = self.pools[t.name]
                rows = entry.prepare_locations(t.host_indices)
                keys = list(t.keys or [])
                if len(rows) != len(keys):
                    raise ValueError(f"pool {name}: {len(keys)} keys for {len(rows)} pages")
                for j, obj in enumerate(self._objects[name]):
                    sid = shape_ids.get((name, j))
                    if sid is None:
                        sid = shape_ids[(name, j)] = len(shapes)
                        per_layer: List[List[Tuple[int, int, int, int]]] = [
                            [] for _ in range(self.num_layers)
                        ]
                        for layer, piece_ids in obj.layer_pieces.items():
                            if 0 <= layer < self.num_layers:
                                per_layer[layer] = [
                                    (obj.offsets[i], *obj.pieces[i]) for i in piece_ids
                                ]
                        shapes.append(per_layer)
                    total = obj.total
                    objects.extend(
                        (self._key(key, obj), total, row, sid) for key, row in zip(keys, rows)
                    )
        return objects, shapes

    def _make_counter(self) -> LayerWiseLoadCounter:
        return NativeLayerCounter(self.num_layers, self.core)

    def _report(self, index: int, layer: int, error: Optional[str]) -> None:
        try:
            if error is None:
                self.layer_done_counter.complete(index, layer)
            else:
                logger.error("kvtier linker load batch %d failed: %s", index, error)
                self.layer_done_counter.fail(index, RuntimeError(error))
        except (KeyError, IndexError):
            pass  # the counter was reset under a running batch

    def start_layer_wise_loading(self) -> int:
        if not self.pending_loads:
            return -1
        pending, self.pending_loads = self.pending_loads, {}
        index = self.layer_done_counter.update_producer()
        try:
            objects, shapes = self._load_plan(list(pending.values()))
            # No report callback: layers complete natively (NativeLayerCounter).
            self.core.submit_load(index, objects, shapes, self.num_layers, None)
        except Exception as exc:
            logger.exception("kvtier linker: cannot start load batch %d", index)
            self.layer_done_counter.fail(index, exc)
        return index

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        return self.layer_done_counter.finish(counter_index)

    # ------------------------------------------------------------------ offload
    def offload(self, transfers: List[PoolTransfer], session_id: Optional[str] = None) -> bool:
        expanded = self.pool_group.resolve_transfers(transfers, allow_partial=True)
        if not expanded:
            return False
        objects: List[Tuple[str, List[Tuple[int, int]]]] = []
        for t in expanded:
            if not self._writes(t.name):
                continue  # another rank writes the one shared copy
            entry = self.pools[t.name]
            rows = entry.prepare_locations(t.host_indices)
            keys = list(t.keys or [])
            if len(rows) != len(keys):
                logger.error("kvtier linker offload: %d keys for %d pages", len(keys), len(rows))
                return False
            for key, row in zip(keys, rows):
                for obj in self._objects[_pool_key(t.name)]:
                    objects.append(
                        (self._key(key, obj), [(b + row * s, n) for b, s, n in obj.pieces])
                    )
        events = self.record_offload_ready()

        def ready() -> None:
            for event in events:
                event.synchronize()

        self.core.submit_offload(objects, ready)
        return True

    def num_completed_offloads(self) -> int:
        return self.core.num_completed_offloads()

    def pop_completed_offload(self) -> bool:
        return self.core.pop_completed_offload()

    # ------------------------------------------------------------------ lifecycle
    def stats(self) -> Dict[str, int]:
        return dict(self.core.stats())

    def reset(self) -> None:
        self.pending_loads.clear()
        self.core.drain()
        self.core.clear_results()
        self.layer_done_counter.reset()

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.pending_loads.clear()
        self.core.close()
        self.store.close()
