"""KV events of kvtier's vLLM tier (issue 30): what ``KvtierTier.take_events`` reports.

vLLM 0.34's tiering manager gathers ``OffloadingEvent``s from every secondary tier
(``SecondaryTierManager.take_events``, called once per scheduler step on the scheduler
thread), its ``OffloadingEventsTracker`` turns them into ``BlockStored`` / ``BlockRemoved``
and vLLM's own ``ZmqEventPublisher`` sends them to routers. What this module owns is the
tier's side of that contract:

- **what kvtier holds of this tier's namespace**: an event for a block is reported only once
  kvtier holds it (``removed=False``) and again once it no longer does (``removed=True``),
  whatever removed it: kvtier's own capacity eviction, an explicit remove, a ``clear``;
- every event carries ``ownership`` (the tier's type, as registered with vLLM),
  ``locality`` (``LOCAL`` for an embedded store or a ``kvtier serve`` of this host, ``REMOTE``
  for a cluster, unless the tier config names one), ``medium`` (``CPU``: kvtier's DRAM tier;
  ``STORAGE``: its SSD tier, embedded mode only) and ``removal_expected=True`` (so vLLM's tracker keeps a block's payload until its removal,
  as for the KVCR tier, the other tier that reports its own removals).

Where the facts come from depends on the store's mode:

- **embedded**: the engine's event ring (``enable_events`` / ``drain_events``) names every
  page group that appeared in or left DRAM, in the order the index changed; a vLLM key
  (``vllm/<model>_<digest>/<block hash hex>_g<group>``, ``kvtier_proto::keys::vllm_key``) is
  its own group, so each event maps back to exactly one ``OffloadKey``. Groups of another
  namespace or of no vLLM shape are counted (``unmapped``), never reported. With the SSD tier
  on, the ring also names groups that appeared on and left the SSD (``enable_media_events``):
  each (block, medium) is one residency, as vLLM's tracker counts them, and a write-back
  demotion is reported ``STORAGE`` stored before ``CPU`` removed, so the block never looks
  absent in between.
- **server / cluster**: the engine runs in another process, so the tier reports its own
  completed stores, and learns removals two ways: a lookup that answers "absent" for a block
  it reported (a failed load proves nothing: it may be a transport error), and a
  reconciliation thread that asks the store which
  reported blocks still exist every ``kv_events_reconcile_s`` seconds (one ``exists_keys``
  batch, without the GIL). A removal is thus reported late (at most one interval); a block
  re-stored while a check ran keeps its credit (a generation number per block). kvtier's
  ``exists_keys`` answers "absent" when the server cannot be reached: its blocks are then
  reported removed (they cannot be served; a later store reports them again).

Invariants: a block is reported stored at most once until it is reported removed (the tier
keeps the set of blocks it reported; ``max`` bounded by what kvtier holds of the namespace);
when the engine's ring overflowed (``dropped``) the tier re-checks every reported block and
reports the vanished ones removed (from every medium), so a router may under-count kvtier's
blocks, never credit one kvtier lost. In server and cluster mode the tier does not see where
the server keeps a block: it reports ``CPU`` while the block exists (the server's host stream
names the medium).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any

from vllm.v1.kv_offload.base import Locality, Medium, OffloadingEvent, OffloadKey, make_offload_key

logger = logging.getLogger(__name__)

# Events taken from the engine's ring per drain call (bounded work per scheduler step).
DRAIN_BATCH = 4096


class TierEventsError(ValueError):
    """A KV-events setting of the vLLM tier that cannot work; names the key."""


def parse_vllm_group(group: str, namespace: str) -> OffloadKey | None:
    """The ``OffloadKey`` of an engine page group ``[store ns]vllm/<ns>/<hex>_g<n>`` of this
    tier's ``namespace``, or None (another namespace, another scheme, a malformed name)."""
    prefix = namespace + "/"
    at = group.find(prefix)
    if at < 0:
        return None
    rest = group[at + len(prefix) :]
    hexpart, sep, idx = rest.rpartition("_g")
    if not sep or not hexpart or not idx.isdigit() or len(hexpart) % 2:
        return None
    try:
        block_hash = bytes.fromhex(hexpart)
        group_idx = int(idx)
    except ValueError:
        return None
    if group_idx >= 1 << 32:
        return None
    return make_offload_key(block_hash, group_idx)


class TierEvents:
    """The event bookkeeping of one ``KvtierTier`` (see the module doc). Scheduler-thread
    methods: :meth:`take`, :meth:`stored`; any thread: :meth:`absent`."""

    def __init__(
        self,
        store: Any,
        namespace: str,
        store_key: Callable[[OffloadKey], str],
        ownership: str,
        locality: Locality | None,
        buffer: int = 65536,
        reconcile_s: float = 5.0,
    ) -> None:
        if buffer < 1:
            raise TierEventsError(f"kvtier vLLM tier key `kv_events_buffer`: {buffer} is below 1")
        if not reconcile_s > 0:
            raise TierEventsError(
                f"kvtier vLLM tier key `kv_events_reconcile_s`: {reconcile_s} is not above 0"
            )
        self._store = store
        self._namespace = namespace
        self._store_key = store_key
        self.ownership = ownership
        self.locality = locality
        self.medium = Medium.CPU
        # True: the engine's ring is the source (embedded mode).
        self.from_engine = bool(store.enable_media_events(int(buffer)))
        self._lock = threading.Lock()
        # Reported blocks (medium CPU) -> generation of their latest store report.
        self._present: dict[OffloadKey, int] = {}
        # Blocks reported on kvtier's SSD tier (medium STORAGE; embedded mode).
        self._on_ssd: set[OffloadKey] = set()
        self._gen = 0
        # Blocks found absent off the scheduler thread: (key, generation seen present).
        self._absent: list[tuple[OffloadKey, int]] = []
        self._dropped_seen = 0
        self._out: list[OffloadingEvent] = []
        self.counts = dict.fromkeys(
            (
                "stored",
                "removed",
                "cleared",
                "unmapped",
                "dropped",
                "resyncs",
                "reconciles",
                "errors",
            ),
            0,
        )
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not self.from_engine:
            self._reconcile_s = float(reconcile_s)
            self._thread = threading.Thread(
                target=self._reconcile_loop, name="kvtier-vllm-events", daemon=True
            )
            self._thread.start()

    # ------------------------------------------------------------------ building events

    def _emit(self, keys: list[OffloadKey], removed: bool, medium: Medium = Medium.CPU) -> None:
        if not keys:
            return
        last = self._out[-1] if self._out else None
        if last is not None and last.removed == removed and last.medium == medium:
            last.keys.extend(keys)
        else:
            self._out.append(
                OffloadingEvent(
                    keys=list(keys),
                    medium=medium,
                    removed=removed,
                    locality=self.locality,
                    ownership=self.ownership,
                    removal_expected=True,
                )
            )
        self.counts["removed" if removed else "stored"] += len(keys)

    def _add(self, keys: Iterable[OffloadKey]) -> None:
        """Report ``keys`` stored (those not reported yet); caller holds the lock."""
        new = []
        for k in keys:
            self._gen += 1
            if k not in self._present:
                new.append(k)
            self._present[k] = self._gen
        self._emit(new, removed=False)

    def _drop(self, keys: Iterable[OffloadKey]) -> None:
        """Report ``keys`` removed (those reported); caller holds the lock."""
        gone = [k for k in keys if self._present.pop(k, None) is not None]
        self._emit(gone, removed=True)

    def _ssd(self, key: OffloadKey, stored: bool) -> None:
        """Report ``key``'s SSD residency (embedded mode); caller holds the lock."""
        if stored and key not in self._on_ssd:
            self._on_ssd.add(key)
            self._emit([key], removed=False, medium=Medium.STORAGE)
        elif not stored and key in self._on_ssd:
            self._on_ssd.discard(key)
            self._emit([key], removed=True, medium=Medium.STORAGE)

    def _drop_everywhere(self, keys: list[OffloadKey]) -> None:
        """Report ``keys`` removed from every medium; caller holds the lock."""
        self._drop(keys)
        for k in keys:
            self._ssd(k, stored=False)

    # ------------------------------------------------------------------ inputs

    def stored(self, keys: list[OffloadKey]) -> None:
        """A store job of ``keys`` completed (server / cluster mode: the tier's own report;
        embedded mode takes the engine's events instead)."""
        if self.from_engine:
            return
        with self._lock:
            self._add(keys)

    def absent(self, keys: Iterable[OffloadKey]) -> None:
        """kvtier answered that ``keys`` are not there (a lookup's per-key answers)."""
        with self._lock:
            for k in keys:
                gen = self._present.get(k)
                if gen is not None:
                    self._absent.append((k, gen))

    def _apply_absent(self) -> None:
        absent, self._absent = self._absent, []
        gone = [k for k, gen in absent if self._present.get(k) == gen]
        self._drop(gone)

    def _drain_engine(self) -> None:
        """Turn the engine's page-group events into reported stores and removals."""
        # Bounded: the ring holds at most `buffer` events, each call takes DRAIN_BATCH.
        for _ in range(1 + (1 << 20) // DRAIN_BATCH):
            events, dropped_total, pending = self._store.drain_events(DRAIN_BATCH)
            for _seq, kind, group, _depth in events:
                if kind == "cleared":
                    self.counts["cleared"] += 1
                    self._drop_everywhere(list(self._present) + list(self._on_ssd))
                    continue
                key = parse_vllm_group(group, self._namespace)
                if key is None:
                    self.counts["unmapped"] += 1
                elif kind == "stored":
                    self._add((key,))
                elif kind in ("ssd_stored", "ssd_removed"):
                    self._ssd(key, stored=kind == "ssd_stored")
                else:  # evicted / removed
                    self._drop((key,))
            if dropped_total > self._dropped_seen:
                self.counts["dropped"] += dropped_total - self._dropped_seen
                self._dropped_seen = dropped_total
                self._resync()
            if not pending:
                return

    def _resync(self) -> None:
        """The ring overflowed: removals may be lost, so re-check every reported block (one
        kvtier no longer holds anywhere is reported removed from every medium)."""
        self.counts["resyncs"] += 1
        keys = list(self._present.keys() | self._on_ssd)
        logger.warning(
            "kvtier vLLM tier events: the engine's ring (kv_events_buffer) overflowed; "
            "re-checking %d reported blocks",
            len(keys),
        )
        found = self._store.exists_keys([self._store_key(k) for k in keys]) if keys else []
        self._drop_everywhere([k for k, f in zip(keys, found) if not f])

    # ------------------------------------------------------------------ scheduler side

    def take(self) -> list[OffloadingEvent]:
        """The events since the last call (scheduler thread). Never raises: a failure is
        logged and counted, and what was built is returned."""
        with self._lock:
            try:
                if self.from_engine:
                    self._drain_engine()
                self._apply_absent()
            except Exception as e:
                self.counts["errors"] += 1
                logger.warning("kvtier vLLM tier events: taking events failed: %s", e)
            out, self._out = self._out, []
        return out

    def _reconcile_loop(self) -> None:
        while not self._stop.wait(self._reconcile_s):
            self.reconcile()

    def reconcile(self) -> None:
        """Ask the store which reported blocks still exist (server / cluster mode, its own
        thread; the store call runs without the GIL and without this lock)."""
        with self._lock:
            snapshot = list(self._present.items())
        if not snapshot:
            return
        try:
            found = self._store.exists_keys([self._store_key(k) for k, _ in snapshot])
        except Exception as e:
            with self._lock:
                self.counts["errors"] += 1
            logger.warning("kvtier vLLM tier events: reconciling failed: %s", e)
            return
        with self._lock:
            self.counts["reconciles"] += 1
            self._absent.extend((k, gen) for (k, gen), f in zip(snapshot, found) if not f)

    def stats(self) -> dict:
        with self._lock:
            return dict(self.counts, reported=len(self._present), reported_ssd=len(self._on_ssd))

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
