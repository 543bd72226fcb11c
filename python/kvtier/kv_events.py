"""KV events: kvtier's page stream in SGLang's format, and SGLang's stream into kvtier.

SGLang publishes ``KVEventBatch`` messages (``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, msgspec msgpack) over a ZMQ PUB socket as ``[topic, seq (8 bytes,
big-endian), payload]`` frames, for KV-aware routers; UMBPStore's ``kv_events_subscriber``
consumes them. kvtier does both sides, from one background thread (:class:`KvEvents`):

- **publish** (``kv_events_publish_endpoint``, ``kv_events_publish_topic``): the engine records
  page-group events in a bounded ring (``kv_events_buffer`` events; when the thread falls
  behind the oldest are dropped and counted, see ``stats()["dropped"]``); the thread drains it
  and publishes one ``KVEventBatch`` per drain, with SGLang's own msgspec classes and frame
  layout, so any SGLang KV-event consumer reads kvtier's stream unchanged. A page stored in
  kvtier's DRAM is a ``BlockStored``, a page evicted or removed is a ``BlockRemoved``, a
  ``clear`` is an ``AllBlocksCleared``; ``medium`` is ``"EXTERNAL"`` (a store outside the
  inference engine, SGLang's tier for Mooncake-like pools). The PUB socket binds the endpoint
  (``tcp://127.0.0.1:0`` picks a free port; :attr:`KvEvents.endpoint` is the bound address).
- **subscribe** (``kv_events_subscriber``, ``kv_events_endpoint``, ``kv_events_topic``, the keys
  and defaults of UMBPStore): kvtier connects a SUB socket to SGLang's publisher. UMBP uses the
  stream to tell its master which GPU/DRAM blocks a node holds; kvtier's store is the L3 below
  those caches, and what it learns is which pages just lost their upper copies: a
  ``BlockRemoved`` from the host cache (``medium`` ``CPU_PINNED``) means the page's only copy
  is now kvtier's, and the next request that needs it will load it from kvtier, so kvtier
  refreshes the page's recency (``touch_groups``) to keep it from being evicted first. A
  ``BlockRemoved`` from the GPU (the host still holds the page), ``BlockStored`` and
  ``AllBlocksCleared`` are counted and change nothing.

Block hashes: SGLang's event hash of a page is the first 16 hex digits of its storage hash as a
signed int64 (``sglang.srt.mem_cache.utils.hash_str_to_int64``), and kvtier's keys carry that
storage hash (``[tag/]page_hash@...``), so kvtier publishes the same numbers SGLang does for
the same page, and maps SGLang's numbers back to its own pages through a table the thread
keeps from the engine's stored/evicted/removed events. Namespaced hashes (LoRA adapters,
``cache_salt``, the ``dynamo`` format) are a different number for the same page and are
counted as ``unknown_hashes``. Events exist in embedded mode only (the server's engine does not
stream its events over the socket): setting these keys in server mode is a config error.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

from kvtier import _native

logger = logging.getLogger(__name__)

MEDIUM = "EXTERNAL"
# SGLang's media whose removal leaves kvtier holding the page's only copy.
ONLY_COPY_MEDIA = frozenset({"CPU_PINNED"})


def page_hash_of_group(group: str) -> str:
    """The page hash of a group name ``[tag/]page_hash@`` (the key scheme is Rust's:
    ``kvtier_proto::keys::page_hash_of``)."""
    return _native.key_page_hash(group)


def event_hash(page_hash: str) -> Optional[int]:
    """SGLang's KV-event block hash of a page (``hash_str_to_int64``), or None when the page
    hash is not hex (not an SGLang page)."""
    head = page_hash[:16]
    if len(head) < 16:
        return None
    try:
        v = int(head, 16)
    except ValueError:
        return None
    return v - (1 << 64) if v >= 1 << 63 else v


class KvEventsError(ValueError):
    """A KV-events setting that cannot work; the message names the config key."""


def check_endpoint(key: str, endpoint: str, bind: bool) -> None:
    """Reject a ``tcp://`` endpoint whose port is not 1..65535 (or 0 / ``*``, any free port,
    when binding): libzmq itself silently binds a random port for ``:99999``."""
    if not endpoint.startswith("tcp://"):
        return
    host, sep, port = endpoint[len("tcp://") :].rpartition(":")
    ok = bool(sep and host) and (
        (port.isdigit() and (0 if bind else 1) <= int(port) <= 65535) or (bind and port == "*")
    )
    if not ok:
        raise KvEventsError(
            f"kvtier config key `{key}`: {endpoint!r} is not tcp://HOST:PORT with a port in "
            f"{'0' if bind else '1'}..65535"
        )


class KvEvents:
    """The background thread of kvtier's KV events (see the module docstring)."""

    def __init__(
        self,
        store: Any,
        *,
        publish_endpoint: Optional[str] = None,
        publish_topic: str = "",
        subscribe_endpoint: Optional[str] = None,
        subscribe_topic: str = "",
        buffer: int = 65536,
        block_size: int = 0,
        poll_ms: int = 20,
        max_batch: int = 4096,
    ):
        import msgspec
        import zmq
        from sglang.srt.disaggregation.kv_events import (
            AllBlocksCleared,
            BlockRemoved,
            BlockStored,
            KVEventBatch,
        )

        self._zmq = zmq
        self._classes = (BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch)
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._store = store
        self.block_size = int(block_size)
        self._poll_ms = int(poll_ms)
        self._max_batch = int(max_batch)
        if publish_endpoint:
            check_endpoint("kv_events_publish_endpoint", publish_endpoint, bind=True)
        if subscribe_endpoint:
            check_endpoint("kv_events_endpoint", subscribe_endpoint, bind=False)
        key = "kv_events_publish_endpoint" if publish_endpoint else "kv_events_subscriber"
        if not store.enable_events(int(buffer)):
            raise KvEventsError(
                f"kvtier config key `{key}`: KV events need the embedded mode (this store is "
                "in server mode, whose engine events are not streamed to clients)"
            )
        self._ctx = zmq.Context.instance()
        self._pub = self._sub = None
        self.endpoint: Optional[str] = None
        self._topic = publish_topic.encode()
        try:
            if publish_endpoint:
                self._pub = self._ctx.socket(zmq.PUB)
                try:
                    self._pub.bind(publish_endpoint)
                except zmq.ZMQError as e:
                    raise KvEventsError(
                        f"kvtier config key `kv_events_publish_endpoint`: cannot bind "
                        f"{publish_endpoint!r}: {e}"
                    ) from None
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            if subscribe_endpoint:
                self._sub = self._ctx.socket(zmq.SUB)
                try:
                    self._sub.connect(subscribe_endpoint)
                except zmq.ZMQError as e:
                    raise KvEventsError(
                        f"kvtier config key `kv_events_endpoint`: cannot connect to "
                        f"{subscribe_endpoint!r}: {e}"
                    ) from None
                self._sub.setsockopt_string(zmq.SUBSCRIBE, subscribe_topic)
        except BaseException:
            self._close_sockets()
            raise
        # int64 event hash -> kvtier page groups with that hash (one per tenant tag).
        self._groups: dict[int, set[str]] = {}
        self._seq = 0
        self._dropped_seen = 0
        self._lock = threading.Lock()
        self._stats = dict.fromkeys(
            (
                "published_batches",
                "published_stored",
                "published_removed",
                "published_cleared",
                "unmapped_groups",
                "dropped",
                "received_batches",
                "received_stored",
                "received_removed",
                "received_cleared",
                "decode_errors",
                "touched_pages",
                "unknown_hashes",
                "publish_errors",
                "engine_events",
            ),
            0,
        )
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvtier-kv-events", daemon=True)
        self._thread.start()

    # -- construction from kvtier's config -------------------------------------------------

    @classmethod
    def from_config(cls, store: Any, config: dict, **kw) -> Optional["KvEvents"]:
        """A running instance for the effective config (``tomllib.loads(store.config_toml())``),
        or None when neither publishing nor subscribing is configured."""
        pub = config.get("kv_events_publish_endpoint")
        sub = bool(config.get("kv_events_subscriber", False))
        if not pub and not sub:
            return None
        return cls(
            store,
            publish_endpoint=pub,
            publish_topic=str(config.get("kv_events_publish_topic", "")),
            subscribe_endpoint=str(config.get("kv_events_endpoint")) if sub else None,
            subscribe_topic=str(config.get("kv_events_topic", "")),
            buffer=int(config.get("kv_events_buffer", 65536)),
            **kw,
        )

    # -- public ---------------------------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            return dict(self._stats)

    def stop(self, timeout: float = 5.0) -> None:
        """Publish what the engine still holds, stop the thread, close the sockets."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("kvtier KV events thread did not stop within %.1f s", timeout)
            return
        self._close_sockets()

    # -- the thread -------------------------------------------------------------------------

    def _close_sockets(self) -> None:
        for s in (self._pub, self._sub):
            if s is not None:
                s.close(linger=200)
        self._pub = self._sub = None

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for k, v in deltas.items():
                self._stats[k] += v

    def _drain(self) -> int:
        """Take what the engine recorded (publish it, update the hash table); returns how many
        events are still pending."""
        try:
            events, dropped_total, pending = self._store.drain_events(self._max_batch)
        except Exception:
            logger.exception("kvtier KV events: draining the engine failed")
            return 0
        if dropped_total > self._dropped_seen:
            lost = dropped_total - self._dropped_seen
            self._dropped_seen = dropped_total
            self._count(dropped=lost)
            logger.warning(
                "kvtier KV events: the engine's ring (kv_events_buffer) dropped %d events "
                "before they were taken",
                lost,
            )
        if events:
            self._count(engine_events=len(events))
            try:
                self._handle_own(events)
            except Exception:
                logger.exception("kvtier KV events: handling the engine's events failed")
        return pending

    def _run(self) -> None:
        zmq = self._zmq
        poller = None
        if self._sub is not None:
            poller = zmq.Poller()
            poller.register(self._sub, zmq.POLLIN)
        while True:
            stopping = self._stop.is_set()
            pending = self._drain()
            if stopping:
                if pending:
                    continue
                return
            if poller is not None:
                ready = dict(poller.poll(0 if pending else self._poll_ms))
                if self._sub in ready:
                    # Pages stored since the drain above must be known before SGLang's
                    # events about them are applied.
                    self._drain()
                    self._receive_all()
            elif not pending:
                self._stop.wait(self._poll_ms / 1000)

    def _handle_own(self, events) -> None:
        BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch = self._classes
        out: list = []
        counts = dict(published_stored=0, published_removed=0, published_cleared=0)
        unmapped = 0
        for _seq, kind, group, _depth in events:
            if kind == "cleared":
                self._groups.clear()
                out.append(AllBlocksCleared())
                counts["published_cleared"] += 1
                continue
            h = event_hash(page_hash_of_group(group))
            if h is None:
                unmapped += 1
                continue
            if kind == "stored":
                self._groups.setdefault(h, set()).add(group)
                out.append(
                    BlockStored(
                        block_hashes=[h],
                        parent_block_hash=None,
                        token_ids=[],
                        block_size=self.block_size,
                        lora_id=None,
                        medium=MEDIUM,
                    )
                )
                counts["published_stored"] += 1
            else:  # evicted / removed: gone from kvtier's DRAM
                members = self._groups.get(h)
                if members is not None:
                    members.discard(group)
                    if not members:
                        del self._groups[h]
                last = out[-1] if out else None
                if isinstance(last, BlockRemoved):
                    last.block_hashes.append(h)
                else:
                    out.append(BlockRemoved(block_hashes=[h], medium=MEDIUM))
                counts["published_removed"] += 1
        self._count(unmapped_groups=unmapped)
        if self._pub is None or not out:
            return
        try:
            payload = self._encoder.encode(KVEventBatch(ts=time.time(), events=out))
            self._pub.send_multipart((self._topic, self._seq.to_bytes(8, "big"), payload))
            self._seq += 1
            self._count(published_batches=1, **counts)
        except Exception:
            self._count(publish_errors=1)
            logger.exception("kvtier KV events: publishing a batch failed")

    def _receive_all(self) -> None:
        zmq = self._zmq
        while True:
            try:
                parts = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 3:
                self._count(decode_errors=1)
                continue
            try:
                batch = self._decoder.decode(parts[2])
            except Exception:
                self._count(decode_errors=1)
                logger.warning("kvtier KV events: undecodable message from the publisher")
                continue
            self._handle_sglang(batch)

    def _handle_sglang(self, batch) -> None:
        BlockStored, BlockRemoved, AllBlocksCleared, _ = self._classes
        stored = removed = cleared = unknown = 0
        touch: list = []
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                stored += 1
            elif isinstance(ev, BlockRemoved):
                removed += 1
                if ev.medium not in ONLY_COPY_MEDIA:
                    continue
                for h in ev.block_hashes:
                    groups = self._groups.get(h)
                    if groups:
                        touch.extend(groups)
                    else:
                        unknown += 1
            elif isinstance(ev, AllBlocksCleared):
                cleared += 1
        touched = self._store.touch_groups(touch) if touch else 0
        self._count(
            received_batches=1,
            received_stored=stored,
            received_removed=removed,
            received_cleared=cleared,
            touched_pages=touched,
            unknown_hashes=unknown + (len(touch) - touched),
        )
