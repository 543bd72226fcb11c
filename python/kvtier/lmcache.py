"""kvtier as LMCache 0.5.6 storage: both plugin kinds (issue 19).

1. The multi-process L2 adapter (``lmcache.v1.distributed``; also what SGLang's
   ``--enable-lmcache`` runs on)::

       {"type": "native_plugin", "module_path": "kvtier.lmcache",
        "class_name": "KvtierL2Connector",
        "adapter_params": {"dram_capacity_bytes": 68719476736}}

   ``KvtierL2Connector`` is the native-client interface LMCache's ``NativeConnectorL2Adapter``
   drives: ``event_fd``, ``submit_batch_get/set/exists/delete``, ``drain_completions``,
   ``close``. Every call maps to one ``kvtier._native.BatchQueue`` batch (Rust threads, a real
   eventfd), so the adapter's demultiplexer wakes on kvtier's completions.

2. The legacy remote-storage plugin (non-MP ``LMCacheEngine`` / ``StorageManager``)::

       remote_storage_plugins: ["kvtier"]
       extra_config:
         remote_storage_plugin.kvtier.module_path: kvtier.lmcache
         remote_storage_plugin.kvtier.class_name: KvtierConnectorAdapter
         kvtier.config: {"dram_capacity_bytes": 68719476736}

   ``KvtierConnectorAdapter`` (a ``ConnectorAdapter``, so LMCache builds the connector with its
   metadata) creates ``KvtierRemoteConnector``: async ``exists/get/put/list/close`` complete
   through the same queue, whose eventfd is watched by LMCache's own event loop; ``exists_sync``
   is synchronous, as LMCache calls it from other threads. Unlike the ``lmcache-kvblockd``
   plugin, ``put`` does not release the memory object (LMCache's RemoteBackend does that after
   ``put`` returns), and ``exists_sync`` is a plain function.

``adapter_params`` / ``kvtier.config`` are kvtier configuration (strictly checked, an unknown key
fails naming it), plus ``threads`` and ``queue_capacity`` of the batch queue. Keys are LMCache's
own strings (``<model>@<kv_rank>@<group>@<chunk_hash>[@salt]`` for the L2 adapter,
``CacheEngineKey.to_string()`` for the legacy plugin) under a ``lmcache/`` or ``lmcache-v1/``
prefix, so they never meet SGLang's or vLLM's keys in a shared store. They are composed by the
key scheme (``kvtier_proto::keys::lmcache_key`` through ``_native``), which makes every chunk
(with its legacy ``.meta`` sidecar) an eviction group of its own (issue 28: before, the
``@`` in LMCache's keys made a whole model one group, and a full store refused every put).
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

from kvtier import _native

logger = logging.getLogger(__name__)

_l2_keys = _native.key_lmcache_l2
_QUEUE_KEYS = ("threads", "queue_capacity")


def _open(params: dict) -> tuple[Any, Any]:
    params = dict(params or {})
    queue_args = {k: int(params.pop(k)) for k in _QUEUE_KEYS if k in params}
    store = _native.Store(json.dumps(params))
    try:
        queue = _native.BatchQueue(
            store, queue_args.get("threads", 2), queue_args.get("queue_capacity", 1024)
        )
    except Exception:
        store.close()
        raise
    return store, queue


class KvtierL2Connector:
    """LMCache's native L2 connector interface over kvtier (see the module doc)."""

    def __init__(self, **adapter_params: Any) -> None:
        self._store, self._queue = _open(adapter_params)

    @property
    def store(self):
        return self._store

    def event_fd(self) -> int:
        return self._queue.event_fd()

    def submit_batch_set(self, keys: list[str], memoryviews: list) -> int:
        return self._queue.submit_put(_l2_keys(keys), list(memoryviews))

    def submit_batch_get(self, keys: list[str], memoryviews: list) -> int:
        return self._queue.submit_get(_l2_keys(keys), list(memoryviews))

    def submit_batch_exists(self, keys: list[str]) -> int:
        return self._queue.submit_exists(_l2_keys(keys))

    def submit_batch_delete(self, keys: list[str]) -> int:
        return self._queue.submit_remove(_l2_keys(keys))

    def drain_completions(self) -> list:
        """``[(future_id, ok, error, per-key bools)]``; resets the eventfd."""
        return self._queue.drain()

    def close(self) -> None:
        self._queue.close()
        self._store.close()


# ------------------------------------------------------------------ legacy remote plugin

try:  # LMCache is optional: the L2 connector above needs none of it.
    from lmcache.v1.storage_backend.connector import ConnectorAdapter, ConnectorContext
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector
    from lmcache.v1.protocol import RemoteMetadata

    _HAVE_LMCACHE = True
except ImportError:  # pragma: no cover - exercised only without LMCache
    _HAVE_LMCACHE = False


if _HAVE_LMCACHE:

    class KvtierRemoteConnector(RemoteConnector):
        """LMCache's ``RemoteConnector`` over kvtier: one object per chunk plus, when LMCache
        saves chunk metadata, a ``.meta`` object (shapes, dtypes, format, length) that lets
        ``get`` allocate the right memory object for partial chunks."""

        def __init__(self, context: "ConnectorContext", params: dict) -> None:
            super().__init__(context.local_cpu_backend.config, context.local_cpu_backend.metadata)
            self.loop = context.loop
            self.local_cpu_backend = context.local_cpu_backend
            self._store, self._queue = _open(params)
            self._waiting: dict[int, asyncio.Future] = {}
            self._fd = self._queue.event_fd()
            self._closed = False
            # The eventfd is watched by LMCache's loop; completions resolve their futures
            # on that loop's thread (where every coroutine of this connector runs).
            self.loop.call_soon_threadsafe(self.loop.add_reader, self._fd, self._on_ready)

        # ---- plumbing

        def _on_ready(self) -> None:
            for fid, ok, error, bools in self._queue.drain():
                fut = self._waiting.pop(fid, None)
                if fut is not None and not fut.done():
                    fut.set_result((ok, error, bools))

        async def _wait(self, fid: int):
            fut = self.loop.create_future()
            self._waiting[fid] = fut
            # The completion may already be in the queue: drain now, not only on the fd.
            self._on_ready()
            return await fut

        def _key(self, key, sidecar: bool = False) -> str:
            return _native.key_lmcache_legacy(key.to_string(), sidecar)

        # ---- RemoteConnector

        async def exists(self, key) -> bool:
            ok, _, bools = await self._wait(self._queue.submit_exists([self._key(key)]))
            return bool(ok and bools and bools[0])

        def exists_sync(self, key) -> bool:
            return bool(self._store.exists_keys([self._key(key)])[0])

        async def get(self, key):
            name = self._key(key)
            if self.save_chunk_meta:
                meta_buf = bytearray(self.remote_metadata_bytes)
                meta_name = self._key(key, sidecar=True)
                ok, _, _ = await self._wait(self._queue.submit_get([meta_name], [meta_buf]))
                if not ok:
                    return None
                meta = RemoteMetadata.deserialize(meta_buf)
                obj = self.local_cpu_backend.allocate(meta.shapes, meta.dtypes, meta.fmt)
            else:
                obj = self.local_cpu_backend.allocate(
                    self.meta_shapes, self.meta_dtypes, self.meta_fmt
                )
            if obj is None:
                return None
            buf = memoryview(obj.byte_array).cast("B")
            n = self._store.object_len(name)
            if n is None or n > len(buf):
                n = len(buf)
            ok, error, _ = await self._wait(self._queue.submit_get([name], [buf[:n]]))
            if not ok:
                if error:
                    logger.warning("kvtier get %s failed: %s", name, error)
                obj.ref_count_down()
                return None
            if not self.save_chunk_meta:
                obj = self.reshape_partial_chunk(obj, n)
            return obj

        async def put(self, key, memory_obj) -> None:
            # The caller (RemoteBackend) releases memory_obj after this returns.
            name = self._key(key)
            buf = memoryview(memory_obj.byte_array).cast("B")
            names, bufs = [name], [buf]
            if self.save_chunk_meta:
                meta = RemoteMetadata(
                    len(buf),
                    memory_obj.get_shapes(),
                    memory_obj.get_dtypes(),
                    memory_obj.get_memory_format(),
                )
                names.append(self._key(key, sidecar=True))
                bufs.append(bytes(meta.serialize()))
            ok, error, _ = await self._wait(self._queue.submit_put(names, bufs))
            if not ok:
                raise RuntimeError(f"kvtier put {name} failed: {error}")

        async def list(self) -> list:
            return []  # kvtier does not enumerate keys for clients

        async def close(self) -> None:
            self._shutdown()

        def _shutdown(self) -> None:
            if self._closed:
                return
            self._closed = True
            try:
                self.loop.remove_reader(self._fd)
            except Exception:
                pass
            self._queue.close()
            self._store.close()

    class KvtierConnectorAdapter(ConnectorAdapter):
        """``ConnectorAdapter`` for the plugin named ``kvtier`` (``plugin://kvtier``, or
        ``kvtier.<instance>``): it claims no other plugin's URL."""

        def __init__(self) -> None:
            super().__init__("kvtier://")

        def can_parse(self, url: str) -> bool:
            if url.startswith("kvtier://"):
                return True
            name = url[len("plugin://") :] if url.startswith("plugin://") else ""
            return name == "kvtier" or name.startswith("kvtier.")

        def create_connector(self, context: "ConnectorContext") -> "KvtierRemoteConnector":
            extra = (context.config.extra_config or {}) if context.config else {}
            name = context.plugin_name or "kvtier"
            params = extra.get(
                f"remote_storage_plugin.{name}.config", extra.get("kvtier.config", {})
            )
            if isinstance(params, str):
                params = json.loads(params)
            return KvtierRemoteConnector(context, dict(params))


__all__ = ["KvtierL2Connector", "KvtierConnectorAdapter", "KvtierRemoteConnector"]
