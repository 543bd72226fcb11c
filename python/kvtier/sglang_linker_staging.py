"""kvtier's direct linker for accelerator device pools (CUDA/ROCm): no GPU code in Rust.

``KvtierStagingLinker`` is ``KvtierLinker`` with a host staging step. kvtier never touches
device memory: every batch gets pinned host staging memory registered with kvtier, and torch
moves bytes between staging and the device pools on a side stream.

- Offload: the side stream waits for the offload's ready events, copies each page's pieces
  device → staging, records an event; kvtier's offload thread waits on that event before it
  reads the staging bytes (existence check first, as in the direct linker).
- Load: kvtier's load thread fills one layer's ranges into staging, then (in the layer report)
  the side stream copies them staging → device and the layer is completed only after that
  copy's event has completed, so SGLang's forward never reads a layer before its bytes are in
  device memory.

Configure it like the direct linker with ``"linker": "KvtierStagingLinker"`` and
``"linker_module_path": "kvtier.sglang_linker_staging"``. Tested on CPU pools only (the same
code path with ``torch.cpu`` streams and events); it has not run on a GPU.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import Any, Dict, List, Optional, Tuple

import torch

from sglang.srt.mem_cache.hicache_storage import PoolTransfer
from sglang.srt.mem_cache.unified_cache.unified_cache_linker import LayerWiseLoadCounter
from sglang.srt.utils import get_device_module

from kvtier.sglang_linker import KvtierLinker, _pool_key

logger = logging.getLogger(__name__)


def _pinned(nbytes: int, device_type: str) -> torch.Tensor:
    return torch.empty(max(1, nbytes), dtype=torch.uint8, pin_memory=device_type not in ("cpu",))


class KvtierStagingLinker(KvtierLinker):
    """See the module docs."""

    direct_device_access = False

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        first = next(iter(self.pools.values())).get_hybrid_pool_buffer()[0]
        self._device_type = first.device.type
        self._dm = get_device_module()
        self._side = self._dm.Stream()
        # Flat byte views of every device buffer, by base pointer.
        self._flat: Dict[int, torch.Tensor] = {}
        for entry in self.pools.values():
            for buf in entry.get_hybrid_pool_buffer():
                self._flat[int(buf.data_ptr())] = buf.view(torch.uint8).reshape(-1)
        self._load_staging: Dict[int, Tuple[torch.Tensor, int, list]] = {}
        self._offload_staging: deque = deque()

    def _make_counter(self) -> LayerWiseLoadCounter:
        # Layers complete from Python, after each staging -> device copy's event.
        return LayerWiseLoadCounter(self.num_layers)

    # Device buffers are not registered: kvtier only sees staging memory.
    def _register_buffers(self) -> List[int]:
        return []

    def _stage(self, nbytes: int) -> Tuple[torch.Tensor, int]:
        t = _pinned(nbytes, getattr(self, "_device_type", "cpu"))
        rid = self._native.register_region(int(t.data_ptr()), int(t.numel()), "linker-staging")
        return t, rid

    def _device_piece(self, base: int, stride: int, row: int, size: int) -> torch.Tensor:
        start = row * stride
        return self._flat[base][start : start + size]

    # ------------------------------------------------------------------ load
    def start_layer_wise_loading(self) -> int:
        if not self.pending_loads:
            return -1
        pending, self.pending_loads = self.pending_loads, {}
        index = self.layer_done_counter.update_producer()
        try:
            objects, shapes = self._load_plan(list(pending.values()))
            sizes = [total for _, total, _, _ in objects]
            staging, rid = self._stage(sum(sizes))
            base = int(staging.data_ptr())
            # Each object lands whole in its own staging slot; the device pieces of each layer
            # are copied from there after kvtier reports the layer.
            staged_objects, copies = [], []
            at = 0
            for (key, total, row, sid), size in zip(objects, sizes):
                staged_objects.append((key, total, 0, len(copies)))
                copies.append((at, row, sid))
                at += size
            staged_shapes = [
                [
                    [(off, base + slot + off, 0, n) for off, _, _, n in shapes[sid][layer]]
                    for layer in range(self.num_layers)
                ]
                for slot, _, sid in copies
            ]
            self._load_staging[index] = (
                staging,
                rid,
                list(zip(copies, [shapes[s] for _, _, s in copies])),
            )
            ready = self._dm.Event()
            ready.record()

            def report(i: int, layer: int, error: Optional[str]) -> None:
                if error is None:
                    try:
                        ready.synchronize()
                        self._copy_layer_to_device(i, layer)
                    except Exception as exc:  # a failed copy fails the layer
                        error = f"staging copy of layer {layer}: {exc}"
                self._report(i, layer, error)

            self.core.submit_load(index, staged_objects, staged_shapes, self.num_layers, report)
        except Exception as exc:
            logger.exception("kvtier staging linker: cannot start load batch %d", index)
            self.layer_done_counter.fail(index, exc)
        return index

    def _copy_layer_to_device(self, index: int, layer: int) -> None:
        staging, _, copies = self._load_staging[index]
        with self._dm.stream(self._side):
            for (slot, row, _), shape in copies:
                for off, b, stride, n in shape[layer]:
                    self._device_piece(b, stride, row, n).copy_(
                        staging[slot + off : slot + off + n], non_blocking=True
                    )
            done = self._dm.Event()
            done.record(self._side)
        done.synchronize()

    def finish_layer_wise_loading(self, counter_index: int) -> bool:
        landed = self.layer_done_counter.finish(counter_index)
        staged = self._load_staging.pop(counter_index, None)
        if staged is not None:
            self._native.unregister_region(staged[1])
        return landed

    # ------------------------------------------------------------------ offload
    def offload(self, transfers: List[PoolTransfer], session_id: Optional[str] = None) -> bool:
        expanded = self.pool_group.resolve_transfers(transfers, allow_partial=True)
        if not expanded:
            return False
        plan: List[Tuple[str, List[Tuple[int, int, int]], int]] = []
        for t in expanded:
            if not self._writes(t.name):
                continue
            entry = self.pools[t.name]
            rows = entry.prepare_locations(t.host_indices)
            keys = list(t.keys or [])
            if len(rows) != len(keys):
                logger.error("kvtier staging offload: %d keys for %d pages", len(keys), len(rows))
                return False
            for key, row in zip(keys, rows):
                for obj in self._objects[_pool_key(t.name)]:
                    plan.append((self._key(key, obj), list(obj.pieces), row))
        total = sum(sum(n for _, _, n in pieces) for _, pieces, _ in plan)
        staging, rid = self._stage(total)
        base = int(staging.data_ptr())
        events = self.record_offload_ready()
        objects = []
        at = 0
        with self._dm.stream(self._side):
            for event in events:
                self._side.wait_event(event)
            for key, pieces, row in plan:
                size = sum(n for _, _, n in pieces)
                piece_at = at
                for b, stride, n in pieces:
                    staging[piece_at : piece_at + n].copy_(
                        self._device_piece(b, stride, row, n), non_blocking=True
                    )
                    piece_at += n
                objects.append((key, [(base + at, size)]))
                at += size
            copied = self._dm.Event()
            copied.record(self._side)
        self._offload_staging.append((staging, rid))
        self.core.submit_offload(objects, copied.synchronize)
        return True

    def pop_completed_offload(self) -> bool:
        ok = super().pop_completed_offload()
        if self._offload_staging:
            _, rid = self._offload_staging.popleft()
            self._native.unregister_region(rid)
        return ok

    def reset(self) -> None:
        super().reset()
        for _, rid in self._offload_staging:
            self._native.unregister_region(rid)
        self._offload_staging.clear()
        for _, rid, _ in self._load_staging.values():
            self._native.unregister_region(rid)
        self._load_staging.clear()
