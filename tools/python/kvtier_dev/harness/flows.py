"""Drive a ``HiCacheStorage`` backend exactly the way SGLang 0.5.23 does.

The storage I/O is done by SGLang's **real controller methods**, called on a
minimal real ``HybridCacheController`` built with ``object.__new__`` (no
threads, no torch.distributed groups; only the attributes those methods read
are set, see ``make_controller``):

* backup:   ``HybridCacheController._page_backup_or_log`` ->
  ``_page_backup`` -> ``_page_backup_with_stable_layout`` (side pools first,
  ``_trailing_chain_groups`` + ``batch_set_v2``) -> ``HiCacheController._page_backup``
  (KV in ``STORAGE_BATCH_SIZE`` = 128-page batches through ``_page_set_zero_copy``
  (``batch_set_v1``) or ``_generic_page_set`` (legacy ``batch_set`` of
  ``get_data_page``)).
* query:    ``HybridCacheController._storage_hit_query`` (one ``batch_exists_v2``
  over the whole span with every aux transfer, or ``batch_exists`` when there
  are none) and ``_sync_prefetch_hit_query`` (the restorable-prefix reduction;
  with no sync groups its all-reduce is a no-op, as on one rank).
* prefetch: ``allocate_storage_hit`` (anchor host staging) then
  ``HybridCacheController._page_transfer`` -> ``HiCacheController._page_transfer``
  (per 128-page batch ``_page_transfer_kv_batch``: ``batch_get_v1`` or legacy
  ``batch_get`` + ``set_from_flat_data_page``, then ``batch_get_v2`` for the
  KV-derived sidecars -- possibly with an empty list) -> ``_page_transfer_sidecar``
  (``_sync_trailing_keys``, ``_resolve_sidecar_nonkv_derived_pool_transfers``,
  ``_trailing_chain_groups`` + ``batch_get_v2`` for the trailing pools).

Reproduced (they live in the radix cache, which needs a whole tree):
the ``PoolTransfer`` lists the cache hands the controller
(``UnifiedRadixCache.write_backup_storage`` / ``prefetch_from_storage`` /
``_build_sidecar_transfers``, ``SWAComponent.build_hicache_transfers`` /
``prepare_prefetch``), the aux staging allocation
(``UnifiedRadixCache._alloc_prefetch_aux_staging``), and the backend attach
order (``HybridCacheController.attach_storage_backend``).  The only patch is
in ``query``: the controller derives page hashes from token ids with
``get_storage_hash_str``; we substitute the caller's ``page_hashes`` for that
one call.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from queue import Queue
from typing import Any, Optional, Sequence
from unittest import mock


from sglang.srt.managers.cache_controller import PrefetchAck
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
from sglang.srt.mem_cache.hicache_storage import (
    STORAGE_BATCH_SIZE,
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
    count_pool_hits,
)
from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller as _hcc
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    HybridCacheController,
    PrefetchOperation,
    StorageOperation,
)
from sglang.srt.mem_cache.pool_host import HostPoolGroup

from kvtier_dev.harness.pools import (
    Dsv4PoolGroup,
    PoolSpec,
    kv_only_group,
    make_storage_config,
    page_nbytes,
)

logger = logging.getLogger(__name__)

PLACEHOLDER_KEY = "__placeholder__"

__all__ = [
    "STORAGE_BATCH_SIZE",
    "PLACEHOLDER_KEY",
    "Call",
    "RecordingBackend",
    "BackupResult",
    "PrefetchResult",
    "as_group_and_specs",
    "create_backend",
    "attach_backend",
    "make_controller",
    "build_backup_transfers",
    "build_prefetch_transfers",
    "backup_span",
    "query_span",
    "prefetch_span",
]


# --------------------------------------------------------------------------
# Pools and specs
# --------------------------------------------------------------------------


def _anchor_spec(host_pool) -> PoolSpec:
    return PoolSpec(
        name=PoolName.KV,
        host_pool=host_pool,
        hit_policy=PoolHitPolicy.ALL_PAGES,
        indices_from_pool=None,
        page_size=host_pool.page_size,
        window_pages=None,
        page_bytes=page_nbytes(host_pool),
        is_anchor=True,
    )


def as_group_and_specs(
    group_or_pool, pool_specs: Optional[Sequence[PoolSpec]] = None
) -> tuple[HostPoolGroup, list[PoolSpec]]:
    """Accept a ``Dsv4PoolGroup``, a ``HostPoolGroup`` (+ ``pool_specs`` if it
    has side pools) or a bare host pool (wrapped as ``build_kv_only_group``
    does).  Returns (group, specs) with the anchor spec first."""
    if isinstance(group_or_pool, Dsv4PoolGroup):
        return group_or_pool.group, list(pool_specs or group_or_pool.specs)
    if isinstance(group_or_pool, HostPoolGroup):
        group = group_or_pool
    else:
        group = kv_only_group(group_or_pool)
    if pool_specs:
        specs = list(pool_specs)
        if not any(s.is_anchor for s in specs):
            specs.insert(0, _anchor_spec(group.anchor_entry.host_pool))
        return group, specs
    if len(group.entries) > 1:
        raise ValueError("a HostPoolGroup with side pools needs pool_specs")
    return group, [_anchor_spec(group.anchor_entry.host_pool)]


def _as_group(group_or_pool) -> HostPoolGroup:
    if isinstance(group_or_pool, Dsv4PoolGroup):
        return group_or_pool.group
    if isinstance(group_or_pool, HostPoolGroup):
        return group_or_pool
    return kv_only_group(group_or_pool)


def _side_specs(specs: Sequence[PoolSpec]) -> list[PoolSpec]:
    return [s for s in specs if not s.is_anchor]


# --------------------------------------------------------------------------
# Backend creation / attach / recording
# --------------------------------------------------------------------------


def create_backend(
    backend_name: str, storage_config: HiCacheStorageConfig, group_or_pool=None
) -> HiCacheStorage:
    """``StorageBackendFactory.create_backend`` (real; wraps the backend in
    SGLang's failure injector when ``SGLANG_TEST_HICACHE_BACKEND_RANDOM_*`` is
    set).  For ``"dynamic"`` the class comes from ``storage_config.extra_config``
    (``backend_name``/``module_path``/``class_name``) and is constructed as
    ``cls(storage_config, {})``."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    anchor = None
    if group_or_pool is not None:
        anchor = _as_group(group_or_pool).anchor_entry.host_pool
    return StorageBackendFactory.create_backend(backend_name, storage_config, anchor)


def attach_backend(backend: HiCacheStorage, group_or_pool) -> None:
    """Registration order of ``HybridCacheController.attach_storage_backend``:
    ``register_mem_pool_host(anchor)``; then ``register_mem_host_pool_v2`` for
    every group entry, the anchor included (as ``PoolName.KV``); then
    ``on_host_pools_registered()`` once."""
    group = _as_group(group_or_pool)
    backend.register_mem_pool_host(group.anchor_entry.host_pool)
    for entry in group.entries:
        backend.register_mem_host_pool_v2(entry.host_pool, entry.name)
    backend.on_host_pools_registered()


def _summ_transfers(transfers):
    return [
        dict(
            name=t.name,
            hit_policy=t.hit_policy,
            keys=None if t.keys is None else list(t.keys),
            indices_from_pool=t.indices_from_pool,
            n_host_indices=None if t.host_indices is None else int(t.host_indices.numel()),
        )
        for t in transfers or []
    ]


def _summ_extra(extra_info):
    if extra_info is None:
        return None
    pk = extra_info.prefix_keys
    return dict(prefix_keys=None if pk is None else list(pk))


@dataclass
class Call:
    method: str
    args: dict
    result: Any = None


class RecordingBackend(HiCacheStorage):
    """Forwards every HiCacheStorage call to ``inner`` and records it
    (method, argument summary, result) in ``self.calls``."""

    def __init__(self, inner: HiCacheStorage):
        self.inner = inner
        self.calls: list[Call] = []

    def _rec(self, method, args, fn):
        call = Call(method, args)
        self.calls.append(call)
        call.result = fn()
        return call.result

    def methods(self) -> list[str]:
        return [c.method for c in self.calls]

    def reset(self):
        self.calls.clear()

    # registration
    def register_mem_pool_host(self, mem_pool_host):
        return self._rec(
            "register_mem_pool_host",
            dict(pool=type(mem_pool_host).__name__),
            lambda: self.inner.register_mem_pool_host(mem_pool_host),
        )

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        return self._rec(
            "register_mem_host_pool_v2",
            dict(pool=type(host_pool).__name__, name=host_pool_name),
            lambda: self.inner.register_mem_host_pool_v2(host_pool, host_pool_name),
        )

    def on_host_pools_registered(self):
        return self._rec("on_host_pools_registered", {}, self.inner.on_host_pools_registered)

    # v2
    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        return self._rec(
            "batch_exists_v2",
            dict(
                keys=list(keys),
                transfers=_summ_transfers(pool_transfers),
                extra_info=_summ_extra(extra_info),
            ),
            lambda: self.inner.batch_exists_v2(keys, pool_transfers, extra_info),
        )

    def batch_get_v2(self, transfers, extra_info=None):
        return self._rec(
            "batch_get_v2",
            dict(transfers=_summ_transfers(transfers), extra_info=_summ_extra(extra_info)),
            lambda: self.inner.batch_get_v2(transfers, extra_info),
        )

    def batch_set_v2(self, transfers, extra_info=None):
        return self._rec(
            "batch_set_v2",
            dict(transfers=_summ_transfers(transfers), extra_info=_summ_extra(extra_info)),
            lambda: self.inner.batch_set_v2(transfers, extra_info),
        )

    # v1
    def batch_get_v1(self, keys, host_indices, extra_info=None):
        return self._rec(
            "batch_get_v1",
            dict(
                keys=list(keys),
                n_host_indices=int(host_indices.numel()),
                extra_info=_summ_extra(extra_info),
            ),
            lambda: self.inner.batch_get_v1(keys, host_indices, extra_info),
        )

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        return self._rec(
            "batch_set_v1",
            dict(
                keys=list(keys),
                n_host_indices=int(host_indices.numel()),
                extra_info=_summ_extra(extra_info),
            ),
            lambda: self.inner.batch_set_v1(keys, host_indices, extra_info),
        )

    # legacy
    def get(self, key, target_location=None, target_sizes=None):
        return self._rec(
            "get", dict(key=key), lambda: self.inner.get(key, target_location, target_sizes)
        )

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return self._rec(
            "batch_get",
            dict(keys=list(keys)),
            lambda: self.inner.batch_get(keys, target_locations, target_sizes),
        )

    def set(self, key, value=None, target_location=None, target_sizes=None):
        return self._rec(
            "set", dict(key=key), lambda: self.inner.set(key, value, target_location, target_sizes)
        )

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        return self._rec(
            "batch_set",
            dict(
                keys=list(keys), value_nbytes=[v.numel() * v.element_size() for v in values or []]
            ),
            lambda: self.inner.batch_set(keys, values, target_locations, target_sizes),
        )

    def exists(self, key):
        return self._rec("exists", dict(key=key), lambda: self.inner.exists(key))

    def batch_exists(self, keys, extra_info=None):
        return self._rec(
            "batch_exists",
            dict(keys=list(keys), extra_info=_summ_extra(extra_info)),
            lambda: self.inner.batch_exists(keys, extra_info),
        )

    def clear(self):
        return self.inner.clear()

    def get_stats(self):
        return self.inner.get_stats()

    def close(self):
        close = getattr(self.inner, "close", None)
        return close() if close else None

    def __getattr__(self, name):  # anything else (backend-specific)
        return getattr(self.__dict__["inner"], name)


# --------------------------------------------------------------------------
# The minimal real controller
# --------------------------------------------------------------------------


def make_controller(
    backend: HiCacheStorage,
    group_or_pool,
    *,
    use_v1: bool = True,
    storage_config: Optional[HiCacheStorageConfig] = None,
    storage_backend_type: str = "dynamic",
) -> HybridCacheController:
    """A real ``HybridCacheController`` made with ``object.__new__``; only the
    attributes the storage methods read are set.  ``use_v1`` selects the
    page get/set functions exactly as ``attach_storage_backend`` does for a
    dynamic backend with ``extra_config["interface_v1"]`` (zero-copy
    ``_page_get_zero_copy`` / ``_page_set_zero_copy``) or without it
    (``_generic_page_get`` / ``_generic_page_set``)."""
    group = _as_group(group_or_pool)
    cc = object.__new__(HybridCacheController)
    cc.storage_backend = backend
    cc.storage_backend_type = storage_backend_type
    cc.enable_storage = True
    cc.mem_pool_host = group
    cc.storage_host_pool = group.anchor_entry.host_pool
    cc.page_size = group.page_size
    cc.is_kv_sharded = False
    cc.host_memory_mode = "cache"
    cc.storage_config = storage_config or make_storage_config()
    cc.prefetch_sync_queue = Queue()
    cc.prefetch_hits_sync_groups = []
    cc.prefetch_completion_sync_groups = []
    cc.host_mem_release_queue = Queue()
    cc._init_extra_host_mem_release_queues()
    if use_v1:
        cc.page_get_func = cc._page_get_zero_copy
        cc.page_set_func = cc._page_set_zero_copy
    else:
        cc.page_get_func = cc._generic_page_get
        cc.page_set_func = cc._generic_page_set
    return cc


# --------------------------------------------------------------------------
# Transfer lists as the radix cache builds them
# --------------------------------------------------------------------------


def build_backup_transfers(
    page_hashes: Sequence[str],
    host_indices_per_pool: dict,
    specs: Sequence[PoolSpec],
) -> list[PoolTransfer]:
    """``UnifiedRadixCache.write_backup_storage`` for one node whose hash
    chain is ``page_hashes``: component transfers (``BACKUP_STORAGE`` phase of
    ``SWAComponent.build_hicache_transfers``: the last ``n`` host pages of the
    node's SWA value with ``keys = hash_value[-n:]``, TRAILING_PAGES), then
    ``_build_sidecar_transfers`` (keys of the source transfer, its hit policy
    and ``indices_from_pool``, no host indices: the controller resolves them;
    skipped when the source has no indices)."""
    page_hashes = list(page_hashes)
    kv_xfer = PoolTransfer(
        name=PoolName.KV,
        host_indices=host_indices_per_pool.get(PoolName.KV),
        keys=page_hashes,
    )
    comp: list[PoolTransfer] = []
    for spec in _side_specs(specs):
        if spec.indices_from_pool is not None:
            continue
        idx = host_indices_per_pool.get(spec.name)
        if idx is None or idx.numel() == 0 or not page_hashes:
            continue
        num_pages = int(idx.numel()) // spec.page_size
        if num_pages == 0:
            continue
        if spec.hit_policy == PoolHitPolicy.TRAILING_PAGES:
            comp.append(
                PoolTransfer(
                    name=spec.name,
                    host_indices=idx[-num_pages * spec.page_size :],
                    keys=page_hashes[-num_pages:],
                    hit_policy=PoolHitPolicy.TRAILING_PAGES,
                )
            )
        else:
            comp.append(
                PoolTransfer(
                    name=spec.name,
                    host_indices=idx,
                    keys=page_hashes[:num_pages],
                    hit_policy=spec.hit_policy,
                )
            )
    sidecars: list[PoolTransfer] = []
    for spec in _side_specs(specs):
        if spec.indices_from_pool is None:
            continue
        if spec.indices_from_pool == PoolName.KV:
            source = kv_xfer
        else:
            source = next((t for t in comp if t.name == spec.indices_from_pool), None)
            if source is None:
                continue
        if source.host_indices is None or len(source.host_indices) == 0:
            continue
        sidecars.append(
            PoolTransfer(
                name=spec.name,
                keys=source.keys,
                hit_policy=spec.hit_policy,
                indices_from_pool=spec.indices_from_pool,
            )
        )
    return comp + sidecars


def build_prefetch_transfers(
    n_pages: int, specs: Sequence[PoolSpec], *, at_root: bool = True
) -> list[PoolTransfer]:
    """``UnifiedRadixCache.prefetch_from_storage`` for a span of ``n_pages``:
    trailing components per ``SWAComponent.prepare_prefetch`` (``window``
    pages, or the whole span when the span starts at the root and is shorter
    than the window) with ``keys=["__placeholder__"] * pages``; KV-derived
    sidecars with ``keys=None`` (the KV transfer has none yet); SWA-derived
    sidecars sharing the SWA placeholder list."""
    kv_xfer = PoolTransfer(name=PoolName.KV, host_indices=None)
    comp: list[PoolTransfer] = []
    for spec in _side_specs(specs):
        if spec.indices_from_pool is not None:
            continue
        if spec.hit_policy != PoolHitPolicy.TRAILING_PAGES:
            raise NotImplementedError(f"prefetch of own-index ALL_PAGES pool {spec.name}")
        window = spec.window_pages or 1
        if n_pages >= window:
            num_pages = window
        elif n_pages > 0 and at_root:
            num_pages = n_pages
        else:
            continue
        comp.append(
            PoolTransfer(
                name=spec.name,
                keys=[PLACEHOLDER_KEY] * num_pages,
                hit_policy=PoolHitPolicy.TRAILING_PAGES,
            )
        )
    sidecars: list[PoolTransfer] = []
    for spec in _side_specs(specs):
        if spec.indices_from_pool is None:
            continue
        if spec.indices_from_pool == PoolName.KV:
            source = kv_xfer
        else:
            source = next((t for t in comp if t.name == spec.indices_from_pool), None)
            if source is None:
                continue
        sidecars.append(
            PoolTransfer(
                name=spec.name,
                keys=source.keys,
                hit_policy=spec.hit_policy,
                indices_from_pool=spec.indices_from_pool,
            )
        )
    return comp + sidecars


# --------------------------------------------------------------------------
# Flows
# --------------------------------------------------------------------------


@dataclass
class BackupResult:
    completed_pages: int  # KV pages the controller counted as written
    pool_hits: dict  # leading successes per side pool (batch_set_v2 results)
    transfers: list[PoolTransfer]  # aux transfers after controller resolution
    operation: Any = None


def backup_span(
    backend: HiCacheStorage,
    group_or_pool,
    page_hashes: Sequence[str],
    host_indices_per_pool: dict,
    prefix_keys: Optional[Sequence[str]] = None,
    use_v1: bool = True,
    *,
    pool_specs: Optional[Sequence[PoolSpec]] = None,
    storage_config: Optional[HiCacheStorageConfig] = None,
) -> BackupResult:
    """Back up one span (one radix node) the way the backup thread does:
    real ``_page_backup_or_log`` on a minimal controller.  Side pools go first
    in ``batch_set_v2`` calls grouped by prefix chain, then KV in 128-page
    batches (``batch_set_v1`` when ``use_v1``, else ``batch_set(keys,
    [get_data_page(...)])``).  ``host_indices_per_pool[PoolName.KV]`` are the
    anchor's token indices for the whole span; a trailing pool (SWA) gets its
    own indices for its last ``n`` pages.  ``prefix_keys`` is the chain before
    the span (None = hicache_storage_pass_prefix_keys off)."""
    group, specs = as_group_and_specs(group_or_pool, pool_specs)
    cc = make_controller(backend, group, use_v1=use_v1, storage_config=storage_config)
    transfers = build_backup_transfers(page_hashes, host_indices_per_pool, specs)
    op = StorageOperation(
        host_indices_per_pool[PoolName.KV],
        [],
        hash_value=list(page_hashes),
        prefix_keys=None if prefix_keys is None else list(prefix_keys),
        pool_transfers=transfers or None,
    )
    cc._page_backup_or_log(op)
    return BackupResult(
        completed_pages=op.completed_tokens // cc.page_size,
        pool_hits=dict(op.pool_storage_result.extra_pool_hit_pages),
        transfers=transfers,
        operation=op,
    )


class _QueryTap:
    """Forwards to the backend and keeps what the existence query returned."""

    def __init__(self, backend):
        self._backend = backend
        self.result = None

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        self.result = self._backend.batch_exists_v2(keys, pool_transfers, extra_info)
        return self.result

    def batch_exists(self, keys, extra_info=None):
        self.result = self._backend.batch_exists(keys, extra_info)
        return self.result

    def __getattr__(self, name):
        return getattr(self._backend, name)


def _new_prefetch_op(page_hashes, page_size, prefix_keys, transfers, rid="kvtier-test"):
    return PrefetchOperation(
        CacheRequestHandle(rid=rid, attempt_id=0),
        [0] * (len(page_hashes) * page_size),  # only the length is read
        last_hash=None,
        prefix_keys=None if prefix_keys is None else list(prefix_keys),
        pool_transfers=transfers or None,
    )


def _run_hit_query(cc, op, page_hashes) -> tuple[list, int, Any]:
    tap = _QueryTap(cc.storage_backend)
    real_backend = cc.storage_backend
    cc.storage_backend = tap
    try:
        with mock.patch.object(_hcc, "get_storage_hash_str", lambda *a, **k: list(page_hashes)):
            hash_value, hit_tokens = cc._storage_hit_query(op)
    finally:
        cc.storage_backend = real_backend
    raw = tap.result
    if isinstance(raw, PoolTransferResult):
        result = raw
    else:  # batch_exists: the controller wraps the count the same way
        result = PoolTransferResult(kv_hit_pages=int(raw or 0), extra_pool_hit_pages={})
    return hash_value, hit_tokens, result


def query_span(
    backend: HiCacheStorage,
    page_hashes: Sequence[str],
    pool_specs=None,
    prefix_keys: Optional[Sequence[str]] = None,
    *,
    at_root: bool = True,
) -> PoolTransferResult:
    """The ``PoolTransferResult`` of the prefetch existence query: one
    ``batch_exists_v2(page_hashes, transfers, extra_info)`` with the transfers
    built as for a prefetch (or ``batch_exists`` when there are no side
    pools; the count is then wrapped as ``PoolTransferResult(n, {})`` like the
    controller does).  ``pool_specs``: a ``Dsv4PoolGroup``, a list of
    ``PoolSpec``, a host pool / group, or None for KV only."""
    page_size = 1
    specs: list[PoolSpec] = []
    if isinstance(pool_specs, Dsv4PoolGroup):
        specs = pool_specs.specs
    elif isinstance(pool_specs, (list, tuple)):
        specs = list(pool_specs)
    elif pool_specs is not None:
        specs = as_group_and_specs(pool_specs)[1]
    if specs:
        page_size = specs[0].page_size
    cc = object.__new__(HybridCacheController)
    cc.storage_backend = backend
    cc.page_size = page_size
    transfers = build_prefetch_transfers(len(page_hashes), specs, at_root=at_root)
    op = _new_prefetch_op(page_hashes, page_size, prefix_keys, transfers)
    _, _, result = _run_hit_query(cc, op, page_hashes)
    return result


@dataclass
class PrefetchResult:
    query: PoolTransferResult  # what batch_exists_v2 / batch_exists returned
    hit_pages: int  # usable prefix after _sync_prefetch_hit_query
    kv_pages: int  # pages the KV loop completed (clamped by KV-derived sidecars)
    counts: dict  # per pool name: pages restored (KV, KV-derived, trailing)
    host_indices: dict  # per pool name: host token indices the data went to
    key_ranges: dict  # per pool name: the page hashes each pool was read for
    operation: Any = None
    acks: list = field(default_factory=list)


def prefetch_span(
    backend: HiCacheStorage,
    group_or_pool,
    page_hashes: Sequence[str],
    prefix_keys: Optional[Sequence[str]] = None,
    use_v1: bool = True,
    *,
    pool_specs: Optional[Sequence[PoolSpec]] = None,
    host_indices_per_pool: Optional[dict] = None,
    storage_config: Optional[HiCacheStorageConfig] = None,
    min_hit_pages: int = 1,
    at_root: bool = True,
) -> PrefetchResult:
    """Query, stage and load a span as the prefetch threads do.

    1. real ``_storage_hit_query`` + ``_sync_prefetch_hit_query``;
    2. anchor staging by the real ``allocate_storage_hit`` (or
       ``host_indices_per_pool[KV][:hit]``), trailing staging as
       ``_alloc_prefetch_aux_staging`` (``min(window, hit)`` pages from the
       pool's allocator, or ``host_indices_per_pool[name]``);
    3. real ``_page_transfer``.

    ``counts`` has, per pool, the pages restored: KV = the KV loop's completed
    pages; KV-derived sidecars = sum of leading successes of their
    ``batch_get_v2`` results; trailing pools = their ``batch_get_v2`` leading
    successes (0 when the KV loop fell short: the controller skips them).
    ``key_ranges`` gives, per pool, the hashes it was loaded for, aligned
    with ``host_indices`` page by page.
    """
    group, specs = as_group_and_specs(group_or_pool, pool_specs)
    host_indices_per_pool = dict(host_indices_per_pool or {})
    tap = RecordingBackend(backend)
    cc = make_controller(tap, group, use_v1=use_v1, storage_config=storage_config)
    ps = cc.page_size
    transfers = build_prefetch_transfers(len(page_hashes), specs, at_root=at_root)
    op = _new_prefetch_op(page_hashes, ps, prefix_keys, transfers)

    hash_value, hit_tokens, query = _run_hit_query(cc, op, page_hashes)
    hit_tokens = cc._sync_prefetch_hit_query(op, hit_tokens)
    op.hash_value = hash_value[: hit_tokens // ps]
    op.storage_hit_count = hit_tokens
    hit_pages = hit_tokens // ps
    empty = PrefetchResult(query, hit_pages, 0, {}, {}, {}, op)
    if hit_pages < min_hit_pages:
        return empty

    # Anchor staging.
    kv_idx = host_indices_per_pool.get(PoolName.KV)
    if kv_idx is not None:
        kv_idx = kv_idx[:hit_tokens]
    else:
        kv_idx, alloc_len = cc.allocate_storage_hit(
            op, hit_tokens, allow_partial=False, min_tokens=ps, evict_host=lambda n: 0
        )
        if kv_idx is None:
            raise RuntimeError(f"anchor host pool cannot stage {hit_tokens} tokens")
    # Aux staging (UnifiedRadixCache._alloc_prefetch_aux_staging).
    for t in op.pool_transfers or []:
        if t.host_indices is not None or t.indices_from_pool:
            continue
        pool = group.entry_map[t.name].host_pool
        num_tokens = min(len(t.keys or ()), hit_pages) * pool.page_size
        if num_tokens == 0:
            continue
        given = host_indices_per_pool.get(t.name)
        t.host_indices = given[:num_tokens] if given is not None else pool.alloc(num_tokens)
        if t.host_indices is None:
            raise RuntimeError(f"{t.name}: cannot stage {num_tokens} tokens")
    op.host_indices = kv_idx

    tap.reset()
    cc._page_transfer(op)

    acks: list[PrefetchAck] = []
    while not cc.prefetch_sync_queue.empty():
        acks.append(cc.prefetch_sync_queue.get())
    kv_done = [a.completed_tokens for a in acks if a.completed_tokens is not None]
    kv_pages = (kv_done[-1] if kv_done else 0) // ps
    trailing_hits: dict = {}
    for a in acks:
        if a.pool_hits:
            trailing_hits.update(a.pool_hits)

    counts: dict = {PoolName.KV: kv_pages}
    host_indices: dict = {PoolName.KV: kv_idx}
    key_ranges: dict = {PoolName.KV: list(op.hash_value)}
    kv_derived = [s.name for s in specs if s.indices_from_pool == PoolName.KV]
    # KV-derived sidecar hits per batch, from the batch_get_v2 calls the KV
    # loop issued (one per 128-page batch, in order).
    derived_counts = {name: 0 for name in kv_derived}
    derived_open = {name: True for name in kv_derived}
    for call in tap.calls:
        if call.method != "batch_get_v2":
            continue
        names = {t["name"] for t in call.args["transfers"]}
        if not names or not names <= set(kv_derived):
            continue
        for name, n in count_pool_hits(call.result or {}).items():
            if derived_open.get(name):
                derived_counts[name] += n
                n_keys = next(
                    len(t["keys"] or []) for t in call.args["transfers"] if t["name"] == name
                )
                if n < n_keys:
                    derived_open[name] = False
    for name in kv_derived:
        counts[name] = derived_counts[name]
        host_indices[name] = kv_idx
        key_ranges[name] = list(op.hash_value)
    for t in op.pool_transfers or []:
        if t.indices_from_pool == PoolName.KV:
            continue
        counts[t.name] = int(trailing_hits.get(t.name, trailing_hits.get(str(t.name), 0)))
        host_indices[t.name] = t.host_indices
        key_ranges[t.name] = list(t.keys or [])
    return PrefetchResult(
        query=query,
        hit_pages=hit_pages,
        kv_pages=kv_pages,
        counts=counts,
        host_indices=host_indices,
        key_ranges=key_ranges,
        operation=op,
        acks=acks,
    )
