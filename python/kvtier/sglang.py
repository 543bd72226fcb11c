"""kvtier as an SGLang HiCache L3 storage backend.

Enable it with::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.sglang", "class_name": "KvtierStore",
        "interface_v1": 1, "hicache_storage_pass_prefix_keys": true}'

This adapter is deliberately thin. It parses nothing itself (the Rust schema does, strictly),
maps SGLang objects to ``(key, pointer, size)`` batches, and folds per-page results. Every
failure is a clean ``False`` / miss plus a log line; nothing here raises into SGLang's
scheduler or I/O threads after construction, and a result that does not have the shape that
was asked for is treated as a miss (fail closed).

Key scheme (composed in :mod:`kvtier.sglang_keys`, shared with the direct linker):
``[tag "/"] page_hash "@" fingerprint [".tp"N] [".pp"N] [".cp"N] [".dcp"N] "." component``.
The fingerprint hashes what makes bytes incompatible (model, pool type, layout, dtype, page
size, per-component byte sizes, pp size, and tp size for TP-sharded objects), so differently
configured deployments can share one store without ever reading each other's bytes. MLA KV
and other rank-replicated pools carry no TP rank: one object per page serves every TP rank.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import threading
import time
import tomllib
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from kvtier import _native
from kvtier.sglang_keys import KEY_FORMAT_VERSION, KeyLayout, pool_query  # noqa: F401

logger = logging.getLogger(__name__)

# KEY_FORMAT_VERSION (re-exported above): the key scheme is defined once, in Rust
# (kvtier_proto::keys, exposed as _native.key_*); kvtier.sglang_keys gathers SGLang's facts.

# extra_config keys that belong to SGLang (the factory and the controller), not to kvtier.
SGLANG_OWNED_KEYS = frozenset(
    {
        "backend_name",
        "module_path",
        "class_name",
        "interface_v1",
        # Read by SGLang's host-pool assembler: "shm" allocates host pools from memfds.
        "allocator",
        "prefetch_threshold",
        "prefetch_timeout_base",
        "prefetch_timeout_per_ki_token",
        "hicache_storage_pass_prefix_keys",
    }
)

SUPPORTED_LAYOUTS = ("page_first", "page_first_direct", "page_head")


def kvtier_extra_config(extra_config: Optional[dict]) -> dict:
    """The part of SGLang's extra_config that is kvtier's to parse."""
    return {k: v for k, v in (extra_config or {}).items() if k not in SGLANG_OWNED_KEYS}


def ssd_rank_subdir(storage_config: Optional[HiCacheStorageConfig]) -> str:
    """The SSD sub-directory of one rank: ``dp{D}[_pp{P}]_tp{T}[_cp{C}]``."""
    cfg = storage_config
    if cfg is None:
        return "dp0_tp0"
    parts = [f"dp{getattr(cfg, 'dp_rank', 0) or 0}"]
    if cfg.pp_size > 1:
        parts.append(f"pp{cfg.pp_rank}")
    parts.append(f"tp{cfg.tp_rank}")
    if getattr(cfg, "attn_cp_size", 1) > 1:
        parts.append(f"cp{cfg.attn_cp_rank}")
    return "_".join(parts)


def _effective_mode(own: dict) -> str:
    """``embedded``, ``server`` or ``cluster``: the mode the store of ``own`` (kvtier's part of
    extra_config, plus ``KVTIER_*`` and any config file) opens in, read natively so that every
    source and spelling counts. Raises ValueError for a bad configuration, as ``Store`` would."""
    effective = tomllib.loads(_native.Store.check_config(json.dumps(own)))
    if "master_address" in effective:
        return "cluster"
    if "server_socket" in effective:
        return "server"
    return "embedded"


def _uses_interface_v1(extra_config: Optional[dict]) -> bool:
    # The same test SGLang's CacheController applies to a dynamic backend.
    return bool((extra_config or {}).get("interface_v1", 0))


def _physical_buffers(pool: Any) -> List[torch.Tensor]:
    """Every non-empty tensor a host pool exposes for zero-copy registration."""
    found: List[Any] = []
    getter = getattr(pool, "get_hybrid_pool_buffer", None)
    if getter is not None:
        try:
            buffers = getter()
        except Exception:  # a pool without buffers of its own
            buffers = None
        if buffers is not None:
            found.extend(buffers if isinstance(buffers, (list, tuple)) else [buffers])
    for name in ("kv_buffer", "k_buffer", "v_buffer", "index_k_buffer", "index_k_scale_buffer"):
        value = getattr(pool, name, None)
        if value is not None:
            found.extend(value if isinstance(value, (list, tuple)) else [value])
    flat: List[torch.Tensor] = []
    seen = set()
    for t in found:
        if isinstance(t, (list, tuple)):
            candidates = list(t)
        else:
            candidates = [t]
        for tensor in candidates:
            if not isinstance(tensor, torch.Tensor) or tensor.numel() == 0:
                continue
            storage = tensor.untyped_storage()
            extent = (int(storage.data_ptr()), int(storage.nbytes()))
            if extent not in seen:
                seen.add(extent)
                flat.append(tensor)
    return flat


def _memfd_of(pool: Any, tensor: torch.Tensor) -> Tuple[Optional[Tuple[int, int]], str]:
    """``((fd, offset), "")`` when ``tensor`` lives in a memfd of the pool's allocator (SGLang's
    ``ShmHostTensorAllocator`` keeps ``allocator.fds`` / ``allocator.mms``), else ``(None, why)``."""
    allocator = getattr(pool, "allocator", None)
    fds = list(getattr(allocator, "fds", None) or [])
    mms = list(getattr(allocator, "mms", None) or [])
    if not fds or len(fds) != len(mms):
        return None, (
            'its host buffers are plain anonymous memory (allocator %s); add "allocator": "shm" '
            "to --hicache-storage-backend-extra-config so the server can map them"
            % type(allocator).__name__
        )
    storage = tensor.untyped_storage()
    start, size = int(storage.data_ptr()), int(storage.nbytes())
    for fd, mm in zip(fds, mms):
        try:
            view = ctypes.c_char.from_buffer(mm)
            base = ctypes.addressof(view)
            del view  # release the buffer export at once
        except (TypeError, ValueError):
            continue
        if base <= start and start + size <= base + len(mm):
            return (int(fd), start - base), ""
    return None, "its buffer is not inside any of the allocator's memfds"


def _normalize_sizes(sizes: Any, count: int) -> List[int]:
    if isinstance(sizes, int):
        return [sizes] * count
    if type(sizes) is list and sizes and type(sizes[0]) is int and len(set(map(type, sizes))) == 1:
        sizes = list(
            sizes
        )  # already exact ints (SGLang's meta): skip a per-item int() (~10 us/batch)
    else:
        sizes = [int(s) for s in sizes]
    if len(sizes) == 1 and count != 1:
        return sizes * count
    return sizes


def _byte_view(tensor: torch.Tensor):
    """A contiguous uint8 numpy view of a CPU tensor (no copy when already contiguous)."""
    flat = tensor.reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    return flat.view(torch.uint8).numpy()


@dataclass
class PoolPlan:
    """How one host pool's pages map to kvtier objects."""

    name: str
    pool: Any
    page_size: int
    # One suffix per component, in get_page_buffer_meta order for one page.
    suffixes: List[str]
    # True when every component pointer lies inside the pool's registered buffers.
    zero_copy: bool
    # Used when zero_copy is False: one object per page, copied via get_data_page.
    page_suffix: str
    # True when one object serves every TP rank (MLA KV, replicated side pools).
    replicated: bool = False
    region_ids: List[int] = field(default_factory=list)
    split_factor: int = 1
    # True when a flat data page (get_data_page(i, flat=True), what SGLang's legacy tensor path
    # moves) is exactly the page's component objects back to back: the legacy path then reads
    # and writes the same objects as the zero-copy path.
    flat_is_components: bool = False
    # Byte size of each component of one page, in order (set when flat_is_components).
    component_sizes: List[int] = field(default_factory=list)

    @property
    def active_suffixes(self) -> List[str]:
        return self.suffixes if self.zero_copy else [self.page_suffix]

    @property
    def component_offsets(self) -> List[Tuple[int, int]]:
        """(offset, size) of each component inside a flat page (flat_is_components only)."""
        offsets, at = [], 0
        for size in self.component_sizes:
            offsets.append((at, size))
            at += size
        return offsets


def _flat_page_is_components(pool: Any, first_index: int, ptrs, sizes) -> bool:
    """Whether the flat data page at ``first_index`` is the concatenation, in order, of the
    components ``get_page_buffer_meta`` names for it (``ptrs``/``sizes``). Proved on the pool's
    own view of the page: one component must be the whole contiguous page, several must be the
    contiguous slices along the view's first dimension, each at its pointer with its size."""
    try:
        view = pool.get_data_page(first_index, flat=False)
    except Exception:
        return False
    if not isinstance(view, torch.Tensor) or view.numel() == 0:
        return False
    if len(ptrs) == 1:
        parts = [view]
    elif view.dim() >= 1 and view.shape[0] == len(ptrs):
        parts = [view[j] for j in range(len(ptrs))]
    else:
        return False
    return all(
        part.is_contiguous()
        and part.data_ptr() == int(ptr)
        and part.numel() * part.element_size() == int(size)
        for part, ptr, size in zip(parts, ptrs, sizes)
    )


class KvtierStorageStats:
    """What ``get_stats()`` returns: SGLang's StorageMetrics fields plus kvtier's counters.

    SGLang's metrics collector reads ``prefetch_pgs``, ``backup_pgs``, ``prefetch_bandwidth``
    and ``backup_bandwidth`` (per call, since the previous ``get_stats``) and may set
    ``prefetch_stats`` on the object, so this is an object, not a dict.
    """

    def __init__(self, store: Dict[str, Any], prefetch_pgs, backup_pgs, prefetch_bw, backup_bw):
        self.store = store
        self.prefetch_pgs = prefetch_pgs
        self.backup_pgs = backup_pgs
        self.prefetch_bandwidth = prefetch_bw
        self.backup_bandwidth = backup_bw

    def __getitem__(self, key: str):
        return self.store[key]

    def as_dict(self) -> Dict[str, Any]:
        return dict(self.store)

    def __repr__(self) -> str:
        return f"KvtierStorageStats({self.store})"


class _CallMeter:
    """Pages and GB/s per get/set call since the last ``get_stats``."""

    def __init__(self):
        self._lock = threading.Lock()
        self._reset()

    def _reset(self):
        self.prefetch_pgs: List[int] = []
        self.backup_pgs: List[int] = []
        self.prefetch_bw: List[float] = []
        self.backup_bw: List[float] = []

    def record(self, is_set: bool, pages: int, nbytes: int, seconds: float):
        if pages == 0:
            return
        gbps = nbytes / seconds / 1e9 if seconds > 0 else 0.0
        with self._lock:
            if is_set:
                self.backup_pgs.append(pages)
                self.backup_bw.append(gbps)
            else:
                self.prefetch_pgs.append(pages)
                self.prefetch_bw.append(gbps)

    def take(self):
        with self._lock:
            out = (self.prefetch_pgs, self.backup_pgs, self.prefetch_bw, self.backup_bw)
            self._reset()
            return out


def _rank_endpoint(endpoint: str, rank: int) -> str:
    """``endpoint`` for TP rank ``rank``: every rank's embedded store publishes its own stream,
    so ranks above 0 add their rank to a fixed TCP port (SGLang's convention for DP ranks) or
    a suffix to an ipc/inproc name; port 0 (any free port) stays 0."""
    if rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        if port.isdigit() and int(port) != 0:
            return f"{base}:{int(port) + rank}"
        return endpoint
    return f"{endpoint}_tp{rank}"


def _start_kv_events(store, tp_rank: int):
    """The running ``KvEvents`` of the store's effective config, or None when unset."""
    s = store.kv_events_settings()
    if not s["publish_endpoint"] and not s["subscriber"]:
        return None
    cfg = {
        "kv_events_publish_endpoint": s["publish_endpoint"],
        "kv_events_publish_topic": s["publish_topic"],
        "kv_events_subscriber": s["subscriber"],
        "kv_events_endpoint": s["endpoint"],
        "kv_events_topic": s["topic"],
        "kv_events_buffer": s["buffer"],
    }
    from kvtier.kv_events import KvEvents

    if cfg.get("kv_events_publish_endpoint"):
        cfg["kv_events_publish_endpoint"] = _rank_endpoint(
            cfg["kv_events_publish_endpoint"], tp_rank
        )
    ev = KvEvents.from_config(store, cfg)
    logger.info(
        "kvtier KV events: publishing on %s (topic %r), subscribed to %s",
        ev.endpoint,
        cfg.get("kv_events_publish_topic", ""),
        cfg.get("kv_events_endpoint") if cfg.get("kv_events_subscriber") else None,
    )
    return ev


class KvtierStore(HiCacheStorage):
    """SGLang HiCache storage backend on a kvtier store (embedded mode)."""

    def __init__(
        self,
        storage_config: Optional[HiCacheStorageConfig] = None,
        mem_pool_host_or_kwargs: Any = None,
    ):
        # The dynamic factory passes (storage_config, kwargs); SGLang's built-in path and
        # direct users pass (storage_config, mem_pool_host).
        mem_pool_host = None
        if mem_pool_host_or_kwargs is not None and not isinstance(mem_pool_host_or_kwargs, dict):
            mem_pool_host = mem_pool_host_or_kwargs
        self.storage_config = storage_config
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        self._interface_v1 = _uses_interface_v1(extra)
        own = kvtier_extra_config(extra)
        # Every rank is its own process with its own embedded store, so each needs its own
        # segment log; the same ranks find the same directory again after a restart.
        # The key may also be given in the [engine] section (issue 16): setting the flat one
        # as well would be refused as given twice.
        engine_section = own.get("engine")
        in_section = isinstance(engine_section, dict) and "ssd_storage_subdir" in engine_section
        # Only an embedded store has a segment log here: in server or cluster mode the engine
        # keys belong to the server's / nodes' configuration, and kvtier refuses them in a
        # client's (issue 27).
        if (
            "KVTIER_SSD_STORAGE_SUBDIR" not in os.environ
            and not in_section
            and _effective_mode(own) == "embedded"
        ):
            own.setdefault("ssd_storage_subdir", ssd_rank_subdir(storage_config))
        # Raises ValueError naming the key for an unknown key or a bad value.
        self._store = _native.Store(json.dumps(own))
        # Server mode (server_socket / KVTIER_SERVER_SOCKET): one store per host, shared by
        # every rank; embedded mode: a store private to this process.
        self._server_mode = self._store.mode == "server"
        self._tag = own.get("extra_backend_tag")

        cfg = storage_config
        # The facts every key of this rank is composed of (shared with the direct linker).
        self.key_layout = KeyLayout.of(cfg, self._tag)
        self._prefix = self.key_layout.prefix
        self._tp_rank = self.key_layout.tp_rank
        self._tp_size = self.key_layout.tp_size
        self._is_mla = self.key_layout.is_mla
        self._split_heads = self.key_layout.split_heads
        self._tp_lcm = self.key_layout.tp_lcm
        is_writer = cfg.is_storage_writer if cfg else True
        # An embedded store is private to this process, so every rank must write its own
        # copy of rank-replicated KV; the local-server mode shares one copy per host, and
        # cluster mode (master_address) one copy per cluster, written by SGLang's storage
        # writer rank and read by every rank.
        self._store_is_process_private = self._store.mode == "embedded"
        self._writes_replicated_kv = is_writer or self._store_is_process_private
        if not is_writer and self._store_is_process_private:
            logger.info(
                "kvtier: TP rank %d is not the MLA storage writer, but the embedded store is "
                "private to this process, so it writes its own copy; use kvtier's server mode "
                "to keep one copy per host.",
                self._tp_rank,
            )

        self.registered_pools: Dict[str, Any] = {}
        self._plans: Dict[str, PoolPlan] = {}
        self._anchor: Optional[PoolPlan] = None
        self._anchor_is_logical = False
        self.mem_pool_host = None
        self._warned: set = set()
        self._meter = _CallMeter()
        self._closed = False
        self._lock = threading.Lock()
        # Largest trailing window (pages) seen per TRAILING_PAGES pool, from existence
        # queries and backups: it bounds which earlier window state a backup supersedes.
        self._trailing_window: Dict[str, int] = {}
        logger.info(
            "kvtier store opened (%s, kv path %s): %s",
            {"server": "server mode", "cluster": "cluster mode"}.get(self._store.mode, "embedded"),
            "v1 zero-copy" if self._interface_v1 else "legacy tensor copy",
            self._store.config_toml().replace("\n", "; "),
        )
        # KV events (kvtier.kv_events): kvtier's page stream and/or SGLang's stream into
        # kvtier, on one background thread; stopped by close().
        self._kv_events = None
        try:
            self._kv_events = _start_kv_events(self._store, self._tp_rank)
        except BaseException:
            self._store.close()
            raise
        if mem_pool_host is not None:
            self.register_mem_pool_host(mem_pool_host)

    # ------------------------------------------------------------------ logging helpers
    def _warn_once(self, tag: str, message: str, *args) -> None:
        if tag in self._warned:
            return
        self._warned.add(tag)
        logger.warning(message, *args)

    def _log_errors(self, op: str, pool: str, errors: Sequence[str]) -> None:
        if errors:
            logger.warning("kvtier %s %s: %s", op, pool, "; ".join(errors))

    # ------------------------------------------------------------------ shared with the linker
    @property
    def native(self) -> Any:
        """The ``kvtier._native.Store`` this adapter opened (the direct linker borrows it)."""
        return self._store

    @property
    def writes_replicated_kv(self) -> bool:
        """Whether this rank writes rank-replicated objects (see ``__init__``)."""
        return self._writes_replicated_kv

    def _probe_meta(self, pool: Any, split_factor: int, first: bool = True):
        page_size = getattr(pool, "page_size", 1) or 1
        size = int(getattr(pool, "size", page_size))
        start = 0 if first else max(0, (size // page_size - 1) * page_size)
        indices = torch.arange(start, start + page_size, dtype=torch.int64)
        if split_factor > 1:
            return pool.get_split_heads_page_buffer_meta(indices, split_factor)
        return pool.get_page_buffer_meta(indices)

    def _register_buffers(self, name: str, pool: Any) -> List[int]:
        ids = []
        for tensor in _physical_buffers(pool):
            storage = tensor.untyped_storage()
            ptr, nbytes = int(storage.data_ptr()), int(storage.nbytes())
            if self._server_mode:
                memfd, why = _memfd_of(pool, tensor)
                if memfd is not None:
                    try:
                        ids.append(
                            self._store.register_memfd(ptr, nbytes, memfd[0], memfd[1], f"{name}")
                        )
                        continue
                    except Exception as exc:  # the server refused the memfd: copy instead
                        why = f"the server refused its memfd ({exc})"
                self._warn_once(
                    f"staged:{name}",
                    "kvtier server mode: pool %s (%s) is not zero-copy because %s; its pages are "
                    "copied through a shared-memory staging ring (one extra copy per page).",
                    name,
                    type(pool).__name__,
                    why,
                )
            ids.append(self._store.register_region(ptr, nbytes, f"{name}"))
        return ids

    def _inside_regions(self, ptrs: Sequence[int], sizes: Sequence[int]) -> bool:
        regions = [(start, start + size) for _, start, size, _ in self._store.regions()]
        return all(any(s <= p and p + n <= e for s, e in regions) for p, n in zip(ptrs, sizes))

    def _plan_pool(self, name: str, pool: Any, *, anchor: bool) -> PoolPlan:
        page_size = int(getattr(pool, "page_size", 1) or 1)
        split_factor = 1
        if anchor and self._split_heads and not self._is_mla:
            split_factor = max(1, self._tp_lcm // max(1, self._tp_size))
        if anchor:
            replicated = self._is_mla and not getattr(pool, "stores_page_envelope", False)
            base = None
        elif name == PoolName.MAMBA:
            replicated, base = False, str(name)  # Mamba state is TP-sharded even under MLA
        else:
            components = getattr(pool, "components", None)
            replicated = self._is_mla or (components is not None and len(components) == 1)
            base = str(name.value if isinstance(name, PoolName) else name)

        region_ids = self._register_buffers(str(name), pool)
        zero_copy = bool(region_ids)
        reason = "it exposes no physical buffer to register"
        suffixes: List[str] = []
        sizes: List[int] = []
        try:
            meta = self._probe_meta(pool, split_factor)
            if meta is None:
                raise ValueError("get_page_buffer_meta returned None")
            ptrs, raw_sizes = meta
            sizes = _normalize_sizes(raw_sizes, len(ptrs))
            last_ptrs, last_sizes = self._probe_meta(pool, split_factor, first=False)
            last_sizes = _normalize_sizes(last_sizes, len(last_ptrs))
            if zero_copy and not (
                self._inside_regions(ptrs, sizes) and self._inside_regions(last_ptrs, last_sizes)
            ):
                zero_copy = False
                reason = "its page pointers fall outside the buffers it exposes"
        except Exception as exc:  # pools without page metadata
            zero_copy = False
            reason = f"get_page_buffer_meta failed ({exc})"
        flat_is_components = (
            zero_copy and split_factor == 1 and _flat_page_is_components(pool, 0, ptrs, sizes)
        )
        if zero_copy:
            fp = self.key_layout.fingerprint(str(name), pool, sizes, replicated, "zero-copy")
            if split_factor > 1:
                per_split = len(sizes) // split_factor
                names = self.key_layout.component_names(base, per_split)
                base_rank = self._tp_rank * split_factor
                suffixes = [
                    _native.key_suffix(fp, self.key_layout.rank_tag(False, base_rank + r), n)
                    for r in range(split_factor)
                    for n in names
                ]
            else:
                names = self.key_layout.component_names(base, len(sizes), pool)
                tag = self.key_layout.rank_tag(replicated)
                suffixes = [_native.key_suffix(fp, tag, n) for n in names]
        else:
            self._warn_once(
                f"slow:{name}",
                "kvtier: pool %s (%s) cannot take the zero-copy path because %s; its pages will "
                "be copied through get_data_page/set_from_flat_data_page (slower, still exact).",
                name,
                type(pool).__name__,
                reason,
            )
        page_bytes = 0
        try:
            page_bytes = int(
                pool.get_dummy_flat_data_page().numel()
                * pool.get_dummy_flat_data_page().element_size()
            )
        except Exception:
            pass
        page_fp = self.key_layout.fingerprint(
            str(name), pool, [page_bytes], replicated, "flat-page"
        )
        page_suffix = _native.key_suffix(
            page_fp, self.key_layout.rank_tag(replicated), base + ".page" if base else "page"
        )
        return PoolPlan(
            name=str(name),
            pool=pool,
            page_size=page_size,
            suffixes=suffixes,
            zero_copy=zero_copy,
            page_suffix=page_suffix,
            replicated=replicated,
            region_ids=region_ids,
            split_factor=split_factor,
            flat_is_components=flat_is_components,
            component_sizes=list(sizes) if flat_is_components else [],
        )

    # ------------------------------------------------------------------ registration
    def register_mem_pool_host(self, mem_pool_host: Any):
        super().register_mem_pool_host(mem_pool_host)
        if self._kv_events is not None:
            self._kv_events.block_size = int(getattr(mem_pool_host, "page_size", 0) or 0)
        self._anchor_is_logical = getattr(mem_pool_host, "kv_buffer", None) is None
        if self._anchor_is_logical:
            # A logical anchor (LogicalHostPool) owns page indices only: no bytes to store.
            self._anchor = None
            logger.info(
                "kvtier: KV anchor %s is logical; side pools carry the data.",
                type(mem_pool_host).__name__,
            )
            return
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in SUPPORTED_LAYOUTS:
            raise ValueError(
                f"kvtier supports host pool layouts {', '.join(SUPPORTED_LAYOUTS)}; got {layout!r}. "
                "Start SGLang with --hicache-mem-layout page_first (or page_first_direct / page_head)."
            )
        self._anchor = self._plan_pool(str(PoolName.KV.value), mem_pool_host, anchor=True)
        if self._interface_v1 and not self._anchor.zero_copy:
            self._warn_once(
                "anchor-slow",
                "kvtier: interface_v1 is set but the KV pool cannot be registered for zero copy; "
                "v1 calls will copy through flat pages.",
            )

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name):
        if host_pool_name == PoolName.KV:
            # SGLang registers the anchor again under KV; v2 KV transfers then move the anchor's
            # pages on the same objects as the v1 and legacy paths.
            anchor = getattr(self, "mem_pool_host", None)
            if anchor is None:
                self.register_mem_pool_host(host_pool)
            elif host_pool is not anchor:
                logger.error(
                    "kvtier: pool %s registered as KV through v2 is not the KV anchor %s; "
                    "v2 KV transfers use the anchor",
                    type(host_pool).__name__,
                    type(anchor).__name__,
                )
            super().register_mem_host_pool_v2(host_pool, host_pool_name)
            return
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._plans[str(host_pool_name)] = self._plan_pool(host_pool_name, host_pool, anchor=False)

    def on_host_pools_registered(self) -> None:
        logger.info(
            "kvtier: pools registered: anchor=%s, side pools=%s, regions=%d",
            "logical"
            if self._anchor_is_logical
            else (self._anchor.suffixes if self._anchor else None),
            {
                name: ("zero-copy" if p.zero_copy else "flat-page")
                for name, p in self._plans.items()
            },
            len(self._store.regions()),
        )

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _depths(extra_info: Optional[HiCacheStorageExtraInfo], pages: int) -> Optional[List[int]]:
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        if prefix is None:
            return None
        base = len(prefix)
        return list(range(base, base + pages))

    def _checked(self, op: str, pool: str, reply, pages: int) -> List[bool]:
        ok, errors = reply
        self._log_errors(op, pool, errors)
        if len(ok) != pages:
            logger.error(
                "kvtier %s %s: %d results for %d pages; treating all as failed",
                op,
                pool,
                len(ok),
                pages,
            )
            return [False] * pages
        return list(ok)

    def _page_io(
        self,
        plan: PoolPlan,
        keys: List[str],
        host_indices: Optional[torch.Tensor],
        is_set: bool,
        extra_info: Optional[HiCacheStorageExtraInfo],
    ) -> List[bool]:
        """Move whole pages of one pool between its host memory and the store."""
        op = "set" if is_set else "get"
        pages = len(keys)
        if pages == 0:
            return []
        if host_indices is None or host_indices.numel() != pages * plan.page_size:
            logger.error(
                "kvtier %s %s: %d keys but %s host indices (page size %d); failing the batch",
                op,
                plan.name,
                pages,
                None if host_indices is None else host_indices.numel(),
                plan.page_size,
            )
            return [False] * pages
        started = time.perf_counter()
        if plan.zero_copy:
            if plan.split_factor > 1:
                ptrs, sizes = plan.pool.get_split_heads_page_buffer_meta(
                    host_indices, plan.split_factor
                )
            else:
                ptrs, sizes = plan.pool.get_page_buffer_meta(host_indices)
            sizes = _normalize_sizes(sizes, len(ptrs))
            want = pages * len(plan.suffixes)
            if len(ptrs) != want or len(sizes) != want:
                logger.error(
                    "kvtier %s %s: %d buffers for %d objects; failing the batch",
                    op,
                    plan.name,
                    len(ptrs),
                    want,
                )
                return [False] * pages
            if is_set:
                reply = self._store.put_pages(
                    self._prefix,
                    keys,
                    plan.suffixes,
                    list(ptrs),
                    sizes,
                    self._depths(extra_info, pages),
                )
            else:
                reply = self._store.get_pages(self._prefix, keys, plan.suffixes, list(ptrs), sizes)
            nbytes = sum(sizes)
        else:
            page_keys = [f"{self._prefix}{k}{plan.page_suffix}" for k in keys]
            firsts = [int(host_indices[i * plan.page_size]) for i in range(pages)]
            if is_set:
                views = [_byte_view(plan.pool.get_data_page(idx, flat=True)) for idx in firsts]
                reply = self._store.put_buffers(page_keys, views, self._depths(extra_info, pages))
                nbytes = sum(v.nbytes for v in views)
            else:
                dummies = [plan.pool.get_dummy_flat_data_page() for _ in firsts]
                reply = self._store.get_buffers(page_keys, [_byte_view(d) for d in dummies])
                nbytes = sum(d.numel() * d.element_size() for d in dummies)
                for ok, idx, page in zip(reply[0], firsts, dummies):
                    if ok:
                        plan.pool.set_from_flat_data_page(idx, page)
        results = self._checked(op, plan.name, reply, pages)
        self._meter.record(is_set, sum(results), nbytes, time.perf_counter() - started)
        return results

    def _anchor_suffixes(self) -> Optional[List[str]]:
        """Suffixes a KV page must have to count, for the KV path SGLang will use. A zero-copy
        anchor's pages are its component objects on every path (v1, v2 and, where the flat
        page is those components, the legacy tensor path); otherwise one flat-page object."""
        if self._anchor_is_logical or self._anchor is None:
            return None
        if self._anchor.zero_copy and (self._interface_v1 or self._anchor.flat_is_components):
            return self._anchor.suffixes
        return [self._anchor.page_suffix]

    def _kv_pages(
        self,
        op: str,
        keys: List[str],
        host_indices: Optional[torch.Tensor],
        is_set: bool,
        extra_info: Optional[HiCacheStorageExtraInfo],
    ) -> List[bool]:
        """KV pages of the anchor, for batch_{set,get}_v1 and v2 transfers named KV alike."""
        if self._anchor_is_logical:
            return [True] * len(keys)  # a logical anchor has no bytes: nothing to move
        if self._no_anchor(op):
            return [False] * len(keys)
        if is_set and self._anchor.replicated and not self._writes_replicated_kv:
            return [True] * len(keys)  # another rank writes the one shared copy of this page
        return self._page_io(self._anchor, keys, host_indices, is_set, extra_info)

    def _legacy_objects(self, keys: List[str], tensors: Sequence[Any]):
        """The objects the legacy tensor path moves for ``keys``: each page's components (as
        slices of its flat tensor) when the flat page is those components, else one flat-page
        object. Returns (names, byte views, page of each object, pages refused); a page whose
        tensor has the wrong size is refused before anything moves."""
        anchor = self._anchor
        names, views, owner, refused = [], [], [], set()
        for page, (key, tensor) in enumerate(zip(keys, tensors)):
            view = _byte_view(tensor)
            if not anchor.flat_is_components:
                names.append(f"{self._prefix}{key}{anchor.page_suffix}")
                views.append(view)
                owner.append(page)
                continue
            if view.nbytes != sum(anchor.component_sizes):
                logger.error(
                    "kvtier legacy %s: page %d is %d bytes, a KV page is %d; failing that page",
                    key,
                    page,
                    view.nbytes,
                    sum(anchor.component_sizes),
                )
                refused.add(page)
                continue
            for suffix, (offset, size) in zip(anchor.suffixes, anchor.component_offsets):
                names.append(f"{self._prefix}{key}{suffix}")
                views.append(view[offset : offset + size])
                owner.append(page)
        return names, views, owner, refused

    @staticmethod
    def _pages_ok(pages: int, owner: List[int], object_ok: List[bool], refused) -> List[bool]:
        """A page succeeded when every one of its objects did and it was not refused."""
        ok = [page not in refused for page in range(pages)]
        for page, good in zip(owner, object_ok):
            ok[page] = ok[page] and bool(good)
        return ok

    def _no_anchor(self, op: str) -> bool:
        if self._anchor is None and not self._anchor_is_logical:
            self._warn_once(
                f"noanchor:{op}", "kvtier %s called before register_mem_pool_host; failing it", op
            )
            return True
        return False

    # ------------------------------------------------------------------ v1 (zero copy)
    def batch_set_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        try:
            return self._kv_pages("batch_set_v1", list(keys), host_indices, True, extra_info)
        except Exception:
            logger.exception("kvtier batch_set_v1 failed; reporting every page as failed")
            return [False] * len(keys)

    def batch_get_v1(
        self,
        keys: List[str],
        host_indices: torch.Tensor,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> List[bool]:
        try:
            return self._kv_pages("batch_get_v1", list(keys), host_indices, False, extra_info)
        except Exception:
            logger.exception("kvtier batch_get_v1 failed; reporting every page as missing")
            return [False] * len(keys)

    def batch_exists(
        self, keys: List[str], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> int:
        try:
            if self._anchor_is_logical:
                return len(keys)
            suffixes = self._anchor_suffixes()
            if suffixes is None:
                return 0
            hit = int(self._store.exists_pages_prefix(self._prefix, list(keys), suffixes))
            return hit if 0 <= hit <= len(keys) else 0
        except Exception:
            logger.exception("kvtier batch_exists failed; reporting a miss")
            return 0

    # ------------------------------------------------------------------ legacy tensor path
    def batch_set(
        self,
        keys: List[str],
        values: Optional[Any] = None,
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        try:
            if not keys:
                return True
            if self._anchor_is_logical:
                return True
            if values is None and target_locations is not None and target_sizes is not None:
                sizes = _normalize_sizes(target_sizes, len(keys))
                reply = self._store.put_keys(
                    list(keys), [int(p) for p in target_locations], sizes, None
                )
                return all(self._checked("batch_set", "raw", reply, len(keys)))
            if values is None or len(values) != len(keys) or self._no_anchor("batch_set"):
                logger.error(
                    "kvtier batch_set: %d keys but %s values",
                    len(keys),
                    None if values is None else len(values),
                )
                return False
            started = time.perf_counter()
            names, views, owner, refused = self._legacy_objects(list(keys), values)
            reply = self._store.put_buffers(names, views, None)
            object_ok = self._checked("batch_set", "kv", reply, len(names))
            ok = self._pages_ok(len(keys), owner, object_ok, refused)
            # A page that failed part way leaves none of its components behind (at worst this
            # also drops an identical copy another writer stored: a lost hit, never wrong bytes).
            partial = [n for n, page, good in zip(names, owner, object_ok) if good and not ok[page]]
            if partial:
                self._store.remove_keys(partial)
            self._meter.record(
                True, sum(ok), sum(v.nbytes for v in views), time.perf_counter() - started
            )
            return all(ok)
        except Exception:
            logger.exception("kvtier batch_set failed")
            return False

    def batch_get(
        self,
        keys: List[str],
        target_locations: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ):
        try:
            if not keys:
                return []
            if self._anchor_is_logical:
                return (
                    list(target_locations) if target_locations is not None else [None] * len(keys)
                )
            if target_locations is None or len(target_locations) != len(keys):
                logger.error(
                    "kvtier batch_get: %d keys but %s targets",
                    len(keys),
                    None if target_locations is None else len(target_locations),
                )
                return [None] * len(keys)
            if target_sizes is not None and not isinstance(target_locations[0], torch.Tensor):
                sizes = _normalize_sizes(target_sizes, len(keys))
                ptrs = [int(p) for p in target_locations]
                ok = self._checked(
                    "batch_get", "raw", self._store.get_keys(list(keys), ptrs, sizes), len(keys)
                )
                return [p if hit else None for p, hit in zip(target_locations, ok)]
            if self._no_anchor("batch_get"):
                return [None] * len(keys)
            started = time.perf_counter()
            for t in target_locations:
                if _byte_view(t).ctypes.data != t.data_ptr():
                    raise ValueError("legacy batch_get targets must be contiguous CPU tensors")
            names, views, owner, refused = self._legacy_objects(list(keys), target_locations)
            reply = self._store.get_buffers(names, views)
            ok = self._pages_ok(
                len(keys), owner, self._checked("batch_get", "kv", reply, len(names)), refused
            )
            self._meter.record(
                False, sum(ok), sum(v.nbytes for v in views), time.perf_counter() - started
            )
            return [t if hit else None for t, hit in zip(target_locations, ok)]
        except Exception:
            logger.exception("kvtier batch_get failed; reporting every page as missing")
            return [None] * len(keys)

    def get(
        self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None
    ):
        if target_location is None:
            return None
        result = self.batch_get(
            [key], [target_location], [target_sizes] if target_sizes is not None else None
        )
        return result[0] if result else None

    def set(
        self,
        key: str,
        value: Optional[Any] = None,
        target_location: Optional[Any] = None,
        target_sizes: Optional[Any] = None,
    ) -> bool:
        if value is not None:
            return self.batch_set([key], [value])
        if target_location is not None and target_sizes is not None:
            return self.batch_set([key], None, [target_location], [target_sizes])
        return False

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ v2 (multi-pool)
    def batch_exists_v2(
        self,
        keys: List[str],
        pool_transfers: Optional[List[PoolTransfer]] = None,
        extra_info: Optional[HiCacheStorageExtraInfo] = None,
    ) -> PoolTransferResult:
        try:
            keys = list(keys)
            names = {}
            pools = []
            for transfer in pool_transfers or []:
                name = str(
                    transfer.name.value if isinstance(transfer.name, PoolName) else transfer.name
                )
                names[name] = transfer.name
                if name == PoolName.KV.value:
                    # The KV anchor is always evaluated (and reported) over the whole span.
                    continue
                plan = self._plans.get(name)
                if plan is None:
                    self._warn_once(
                        f"unreg:{name}",
                        "kvtier batch_exists_v2: pool %s is not registered; its pages are misses",
                        name,
                    )
                    suffixes: List[str] = []
                else:
                    suffixes = plan.active_suffixes
                query, problem = pool_query(
                    name,
                    transfer.hit_policy,
                    suffixes,
                    transfer.keys,
                    getattr(transfer, "group_pages", None),
                )
                if problem:
                    logger.error("kvtier batch_exists_v2: %s", problem)
                elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                    self._learn_window(name, query[3])
                pools.append(query)
            if self._no_anchor("batch_exists_v2"):
                return PoolTransferResult(0, {}, [])
            kv_hit, pool_hits, restorable = self._store.exists_v2(
                self._prefix, keys, self._anchor_suffixes(), pools
            )
            if not 0 <= kv_hit <= len(keys):
                logger.error(
                    "kvtier batch_exists_v2: kv hit %d outside [0, %d]; reporting a miss",
                    kv_hit,
                    len(keys),
                )
                return PoolTransferResult(0, {}, [])
            if any(not 0 <= boundary <= len(keys) for _, boundary in pool_hits):
                logger.error(
                    "kvtier batch_exists_v2: a pool verdict outside [0, %d] (%s); reporting a miss",
                    len(keys),
                    pool_hits,
                )
                return PoolTransferResult(0, {}, [])
            # Every evaluated pool's own boundary, 0 included (see the README's verdict rule).
            hit_count = {}
            for name, boundary in pool_hits:
                hit_count[PoolName.KV if name == "kv" else names.get(name, name)] = boundary
            # The native call returns ints already: no per-item conversion on this hot path.
            return PoolTransferResult(kv_hit, hit_count, list(restorable))
        except Exception:
            logger.exception("kvtier batch_exists_v2 failed; reporting a miss")
            return PoolTransferResult(0, {}, [])

    def _batch_io_v2(
        self, transfers: List[PoolTransfer], is_set: bool, extra_info
    ) -> Dict[Any, List[bool]]:
        results: Dict[Any, List[bool]] = {}
        for transfer in transfers or []:
            keys = list(transfer.keys or [])
            name = str(
                transfer.name.value if isinstance(transfer.name, PoolName) else transfer.name
            )
            try:
                if name == PoolName.KV.value:
                    results[transfer.name] = self._kv_pages(
                        f"batch_{'set' if is_set else 'get'}_v2",
                        keys,
                        transfer.host_indices,
                        is_set,
                        extra_info,
                    )
                    continue
                plan = self._plans.get(name)
                if plan is None:
                    self._warn_once(
                        f"unreg-io:{name}",
                        "kvtier batch_%s_v2: pool %s is not registered; failing its pages",
                        "set" if is_set else "get",
                        name,
                    )
                    results[transfer.name] = [False] * len(keys)
                    continue
                results[transfer.name] = self._page_io(
                    plan, keys, transfer.host_indices, is_set, extra_info
                )
            except Exception:
                logger.exception(
                    "kvtier batch_%s_v2 failed for pool %s", "set" if is_set else "get", name
                )
                results[transfer.name] = [False] * len(keys)
        return results

    def _learn_window(self, pool: str, pages: int) -> None:
        if pages > self._trailing_window.get(pool, 0):
            self._trailing_window[pool] = pages

    def _demote_superseded(
        self, transfers: List[PoolTransfer], results: Dict[Any, List[bool]], extra_info
    ) -> None:
        """After a backup that continued a chain, tell the store that older window state
        (TRAILING_PAGES pools: SWA, Mamba state) on that chain is superseded: only a request
        ending exactly at an older end still needs it, so it may be evicted before whole
        pages. A hint only: a wrong guess costs hit rate, never bytes.

        SGLang's controller sends one ``batch_set_v2`` per pool family, each with the chain
        before its own keys as ``prefix_keys``: the ALL_PAGES call starts where the backed-up
        node starts (so its prefix ends at the previous end), the trailing call at the new
        window. Every call names the trailing pools seen so far for the chain pages before
        the new end's window that it can see: [len(prefix) - window, end - window)."""
        prefix = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        if not transfers or not all(all(ok) for ok in results.values()):
            return
        for t in transfers:
            if t.hit_policy == PoolHitPolicy.TRAILING_PAGES and t.keys:
                name = str(t.name.value if isinstance(t.name, PoolName) else t.name)
                self._learn_window(name, len(t.keys))
        if not prefix or not self._trailing_window:
            return
        # The transfers of one call all end at the node's end; the longest names the most.
        new_keys = max((list(t.keys or []) for t in transfers), key=len)
        chain = list(prefix) + new_keys
        for name, window in self._trailing_window.items():
            plan = self._plans.get(name)
            if plan is None:
                continue
            span = _native.key_superseded_range(len(prefix), len(new_keys), window)
            if span is not None:
                start, stop = span
                self._store.demote_pages(self._prefix, chain[start:stop], plan.active_suffixes)

    def batch_get_v2(
        self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> Dict[Any, List[bool]]:
        return self._batch_io_v2(transfers, False, extra_info)

    def batch_set_v2(
        self, transfers: List[PoolTransfer], extra_info: Optional[HiCacheStorageExtraInfo] = None
    ) -> Dict[Any, List[bool]]:
        results = self._batch_io_v2(transfers, True, extra_info)
        try:
            self._demote_superseded(transfers, results, extra_info)
        except Exception:
            logger.exception("kvtier batch_set_v2: eviction hint failed (the pages are stored)")
        return results

    # ------------------------------------------------------------------ lifecycle
    def clear(self) -> bool:
        try:
            self._store.clear()
            return True
        except Exception:
            logger.exception("kvtier clear failed")
            return False

    def flush(self) -> bool:
        try:
            self._store.flush()
            return True
        except Exception:
            logger.exception("kvtier flush failed")
            return False

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.flush()
        if self._kv_events is not None:
            self._kv_events.stop()
        self._store.close()

    def get_stats(self) -> KvtierStorageStats:
        store = dict(self._store.stats())
        return KvtierStorageStats(store, *self._meter.take())
