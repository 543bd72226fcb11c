"""KV events of kvtier's vLLM tier (issue 30): ``KvtierTier.take_events`` reports what kvtier
holds and loses, and vLLM 0.34's own ``ZmqEventPublisher`` carries it to routers.

Real vLLM objects (see _vllm_engine): the tiering manager and its CPU primary tier, the v1
``Scheduler`` with the ``OffloadingConnector`` (scheduler and worker roles), vLLM's
``ZmqEventPublisher`` (PUB + ROUTER replay) configured through ``KVEventsConfig``, and vLLM's
msgspec ``KVEventBatch`` decoder on the subscriber side. Real kvtier: embedded stores and a
real ``kvtier serve``. Substituted (no GPU), as in test_vllm_tier: the worker's copy and the
model forward. The oracle of every eviction test is kvtier itself: the blocks a router credits
to kvtier (stored minus removed) are exactly those ``exists_keys`` finds.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import msgspec
import pytest
import zmq

import _vllm_engine as ve
import test_cluster as tc
import test_host_events as he
import test_server_mode as sm
from test_vllm_tier import FULL_BLOCKS, PROMPT, TIER, check_loaded_from_kvtier  # noqa: F401

# The tier tests' fixtures (engines closed at the end, no leftover regions), shared.
from test_vllm_tier import _no_leftover_regions, engines  # noqa: F401

kvtier_bin = sm.kvtier_bin
cluster = tc.cluster


def tier_events(manager, ownership="KvtierTier"):
    """The tier's OffloadingEvents from vLLM's manager (every tier's events, this tier's kept)."""
    return [ev for ev in manager.take_events() if ev.ownership == ownership]


class Credit:
    """What a router following the events believes kvtier holds."""

    def __init__(self):
        self.held: set = set()
        self.events = 0

    def apply(self, events):
        for ev in events:
            self.events += 1
            for k in ev.keys:
                if ev.removed:
                    assert k in self.held, "a removal of a block never reported stored"
                    self.held.discard(k)
                else:
                    assert k not in self.held, "a block reported stored twice"
                    self.held.add(k)


def truth(tier, keys):
    found = tier._store.exists_keys([tier.store_key(k) for k in keys])
    return {k for k, f in zip(keys, found) if f}


# ------------------------------------------------------------------ the manager, embedded


def test_embedded_tier_reports_stores_evictions_and_clear(engines):
    from vllm.v1.kv_offload.base import Locality, Medium

    # kvtier holds 16 chunks of 64 KiB; 96 are stored through it (as test_vllm_tier's
    # eviction test): kvtier evicts 80 on its own.
    e = engines(
        [dict(TIER, dram_capacity_bytes=1 << 20, dram_block_size=65536)],
        events=True,
    )
    assert e.tier._events is not None and e.tier._events.from_engine
    keys = ve.request_keys("events-evict", 96)
    credit = Credit()
    for i in range(0, 96, 8):
        e.offload(keys[i : i + 8])
        evs = tier_events(e.manager)
        for ev in evs:
            assert ev.medium is Medium.CPU
            assert ev.locality is Locality.LOCAL
            assert ev.removal_expected
        credit.apply(evs)
        assert credit.held == truth(e.tier, keys)
    assert 0 < len(credit.held) <= 16
    stats = e.tier.stats()
    assert stats["kv_events_stored"] == 96
    assert stats["kv_events_removed"] == 96 - len(credit.held)
    # A key of no vLLM shape in the same store is counted, never reported (its put may
    # evict a block of the full store: that removal is reported).
    e.tier._store.put_buffers(["not-a-vllm-key"], [bytearray(64)])
    evs = tier_events(e.manager)
    assert all(ev.removed for ev in evs)
    credit.apply(evs)
    assert credit.held == truth(e.tier, keys)
    assert e.tier.stats()["kv_events_unmapped"] >= 1
    # kvtier's own clear removes every block it held.
    e.tier._store.clear()
    credit.apply(tier_events(e.manager))
    assert credit.held == set() == truth(e.tier, keys)


def test_embedded_tier_reports_each_blocks_medium(engines, tmp_path):
    """With kvtier's SSD tier (write-back) under 1 MiB of DRAM, each block is reported on the
    medium kvtier keeps it on: ``CPU`` (DRAM) or ``STORAGE`` (SSD); a demotion is ``STORAGE``
    stored before ``CPU`` removed (no held block ever looks absent). The oracle: the engine's
    own placement of each key."""
    from vllm.v1.kv_offload.base import Medium

    e = engines(
        [
            dict(
                TIER,
                dram_capacity_bytes=1 << 20,
                dram_block_size=65536,
                ssd_enabled=True,
                ssd_storage_dir=str(tmp_path / "ssd"),
                ssd_write_policy="write_back",
                ssd_capacity_bytes=64 << 20,
                ssd_segment_size_bytes=4 << 20,
            )
        ],
        events=True,
    )
    keys = ve.request_keys("events-media", 48)
    held: dict = {}
    vanished = set()
    for i in range(0, 48, 8):
        e.offload(keys[i : i + 8])
        for ev in tier_events(e.manager):
            for k in ev.keys:
                media = held.setdefault(k, set())
                if ev.removed:
                    assert ev.medium in media, "a removal from a medium never reported"
                    media.discard(ev.medium)
                    if not media:
                        del held[k]
                        vanished.add(k)
                else:
                    assert ev.medium not in media, "a block reported twice on one medium"
                    media.add(ev.medium)
    truth = {}
    for k in keys:
        dram, ssd = e.tier._store.placement(e.tier.store_key(k))
        media = {m for m, on in ((Medium.CPU, dram), (Medium.STORAGE, ssd)) if on is not None}
        if media:
            truth[k] = media
    assert held == truth
    assert sum(1 for m in truth.values() if m == {Medium.STORAGE}) >= 16, truth
    assert not vanished, "a demoted block was reported gone"
    # kvtier's clear removes every residency.
    e.tier._store.clear()
    for ev in tier_events(e.manager):
        assert ev.removed
        for k in ev.keys:
            held[k].discard(ev.medium)
    assert all(not m for m in held.values())


def test_events_are_off_unless_vllm_publishes_them(engines):
    off = engines([dict(TIER, dram_capacity_bytes=8 << 20)])
    assert off.tier._events is None
    opted_out = engines(
        [dict(TIER, dram_capacity_bytes=8 << 20, enable_kv_events=False)], events=True
    )
    assert opted_out.tier._events is None
    keys = ve.request_keys("quiet", 4)
    for e in (off, opted_out):
        e.offload(keys)
        assert tier_events(e.manager) == []
    with pytest.raises(ValueError, match="enable_kv_events"):
        ve.Engine([dict(TIER, enable_kv_events="yes")], events=True)


def test_ring_overflow_resyncs_and_never_over_credits(engines):
    # A ring of 4 events, 16 chunks per round: most events are dropped before the step takes
    # them; the tier re-checks what it reported, so a router never credits a lost block.
    e = engines(
        [dict(TIER, dram_capacity_bytes=1 << 20, dram_block_size=65536, kv_events_buffer=4)],
        events=True,
    )
    keys = ve.request_keys("overflow", 64)
    credit = Credit()
    for i in range(0, 64, 16):
        e.offload(keys[i : i + 16])
        credit.apply(tier_events(e.manager))
        assert credit.held <= truth(e.tier, keys)
    stats = e.tier.stats()
    assert stats["kv_events_dropped"] > 0 and stats["kv_events_resyncs"] > 0


# ------------------------------------------------------------------ the manager, kvtier serve


def test_server_mode_reports_own_stores_and_removals_by_others(engines, kvtier_bin, tmp_path):
    """Two vLLM instances on one ``kvtier serve`` of 1 MiB: B's stores evict A's blocks in the
    server; A learns it (reconciliation) and reports them removed."""
    served = sm.Served(kvtier_bin, tmp_path, "--engine", "dram_block_size=65536", dram="1MiB")
    try:
        cfg = dict(TIER, server_socket=served.socket, kv_events_reconcile_s=0.1)
        a = engines([cfg], events=True)
        b = engines([cfg], events=True)
        assert a.tier._events is not None and not a.tier._events.from_engine
        keys = ve.request_keys("server-events", 12)
        credit = Credit()
        a.offload(keys)
        credit.apply(tier_events(a.manager))
        assert credit.held == set(keys) == truth(a.tier, keys)
        b.offload(ve.request_keys("other-instance", 16))  # evicts A's blocks in the server
        assert truth(a.tier, keys) != set(keys)
        deadline = time.monotonic() + 10
        while True:
            credit.apply(tier_events(a.manager))
            if credit.held == truth(a.tier, keys):
                break
            assert credit.held >= truth(a.tier, keys), "a block credited that kvtier lost"
            assert time.monotonic() < deadline, "A never reported the evicted blocks"
            time.sleep(0.05)
        assert a.tier.stats()["kv_events_reconciles"] >= 1
    finally:
        served.stop()


def test_cluster_mode_reports_remote_blocks_and_their_removal(engines, cluster):
    """A tier on a real kvtier cluster (master + node): its blocks are REMOTE (they may sit on
    any node); a removal done through the cluster is reported after reconciliation."""
    from vllm.v1.kv_offload.base import Locality

    c = cluster()
    c.add_node("node-a", "127.0.0.2")
    c.master.wait_nodes(["node-a"])
    e = engines([dict(TIER, kv_events_reconcile_s=0.1, **c.store_config("node-a"))], events=True)
    assert e.tier._store.mode == "cluster" and not e.tier._events.from_engine
    keys = ve.request_keys("cluster-events", 6)
    e.offload(keys)
    credit = Credit()
    evs = tier_events(e.manager)
    assert evs and all(ev.locality is Locality.REMOTE for ev in evs)
    credit.apply(evs)
    assert credit.held == set(keys) == truth(e.tier, keys)
    e.tier._store.remove_keys([e.tier.store_key(k) for k in keys[:2]])
    deadline = time.monotonic() + 10
    while credit.held != truth(e.tier, keys):
        assert time.monotonic() < deadline, "the removals were never reported"
        time.sleep(0.05)
        credit.apply(tier_events(e.manager))
    assert credit.held == set(keys[2:])


# ------------------------------------------------------------------ vLLM's scheduler + publisher


class Subscriber:
    """A router's side of vLLM's ZMQ protocol: SUB for the live stream, DEALER for replay,
    decoded with vLLM's own msgspec types. Endpoints are ipc sockets in a private directory,
    which vLLM's publisher binds; :meth:`connect` once it exists."""

    TOPIC = "kvtier-test"

    def __init__(self):
        from vllm.distributed.kv_events import KVEventBatch

        self.dir = tempfile.mkdtemp(prefix="kve")
        self.pub = f"ipc://{self.dir}/pub"
        self.replay_ep = f"ipc://{self.dir}/replay"
        self.ctx = zmq.Context.instance()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, self.TOPIC)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.live: dict[int, object] = {}

    def connect(self):
        self.sub.connect(self.pub)
        time.sleep(0.3)  # the subscription reaches the PUB (it drops what it sends before)

    def config(self):
        from vllm.config.kv_events import KVEventsConfig

        return KVEventsConfig(
            enable_kv_cache_events=True,
            publisher="zmq",
            endpoint=self.pub,
            replay_endpoint=self.replay_ep,
            topic=self.TOPIC,
        )

    def receive(self, timeout=1.0):
        """Every batch that arrives within ``timeout`` of the last one."""
        while self.sub.poll(int(timeout * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.TOPIC.encode()
            self.live[int.from_bytes(seq, "big")] = self.decoder.decode(payload)
            timeout = 0.2

    def replay(self, start):
        """vLLM's replay protocol (``test_host_events.replay_batches``), decoded."""
        raw = he.replay_batches(self.ctx, self.replay_ep, start)
        return {seq: self.decoder.decode(payload) for seq, payload in raw.items()}

    def close(self):
        self.sub.close(linger=0)
        shutil.rmtree(self.dir, ignore_errors=True)


def events_of(batches, kind, **match):
    out = []
    for seq in sorted(batches):
        for ev in batches[seq].events:
            if type(ev).__name__ == kind and all(getattr(ev, k) == v for k, v in match.items()):
                out.append(ev)
    return out


def hashes(evs):
    return [h for ev in evs for h in ev.block_hashes]


def test_vllm_publishes_kvtier_blocks_with_the_engines_hashes(tmp_path):
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    sub = Subscriber()
    v = ve.VllmInstance(
        tmp_path, [dict(TIER, dram_capacity_bytes=32 << 20)], kv_events=sub.config()
    )
    try:
        sub.connect()
        req, seen = v.run(PROMPT)
        for _ in range(3):
            v.step()  # idle steps: the events of the last completions
        sub.receive()
        want = [maybe_convert_block_hash(h) for h in req.block_hashes[:FULL_BLOCKS]]
        kvtier_stored = events_of(sub.live, "BlockStored", ownership="KvtierTier")
        assert sorted(hashes(kvtier_stored)) == sorted(want)
        for ev in kvtier_stored:
            assert (ev.medium, ev.locality) == ("CPU", "LOCAL")
        # The same numbers the engine's own (GPU prefix cache) events use for these tokens.
        gpu = set(hashes(events_of(sub.live, "BlockStored", medium="GPU")))
        assert set(want) <= gpu
        # A load from kvtier still works with events on.
        v.wipe()
        req2, seen2 = v.run(PROMPT)
        check_loaded_from_kvtier(v, req2, seen2)
        # kvtier's own clear: vLLM publishes the removals.
        v.tier._store.clear()
        for _ in range(3):
            v.step()
        sub.receive()
        removed = events_of(sub.live, "BlockRemoved", ownership="KvtierTier")
        assert sorted(hashes(removed)) == sorted(want)
        assert all(ev.locality == "LOCAL" for ev in removed)
        # A router that missed everything replays from 0: every batch, in order, then the end.
        replayed = sub.replay(0)
        assert sorted(replayed) == list(range(len(replayed)))
        assert set(sub.live) <= set(replayed)
        assert sorted(hashes(events_of(replayed, "BlockRemoved", ownership="KvtierTier"))) == (
            sorted(want)
        )
        # ... and from the middle: only the tail.
        mid = max(replayed) // 2
        assert sorted(sub.replay(mid)) == list(range(mid, max(replayed) + 1))
    finally:
        v.close()
        sub.close()
