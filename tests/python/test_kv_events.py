"""KV events over real ZMQ sockets with SGLang 0.5.23's own msgspec classes and publisher.

- kvtier publishes: a SUB socket decodes kvtier's stream with SGLang's ``KVEventBatch``
  decoder; stores, evictions under a small DRAM budget, removes and a clear arrive with the
  counts and hashes the engine reports.
- kvtier subscribes: SGLang's real ``ZmqEventPublisher`` sends ``BlockRemoved`` from the host
  cache; kvtier refreshes that page, so a later eviction takes another one.
- the SGLang adapter starts the thread from its config and stops it on close; bad endpoints
  fail naming the key.
"""

from __future__ import annotations

import hashlib
import json
import time

import msgspec
import numpy as np
import pytest
import zmq
from sglang.srt.disaggregation.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    ZmqEventPublisher,
)
from sglang.srt.mem_cache.utils import hash_str_to_int64

from kvtier import _native
from kvtier.kv_events import KvEvents, KvEventsError, event_hash, page_hash_of_group

OBJ = 64 * 1024  # one component
COMPONENTS = ("swa", "c4")  # two objects per page


def page_hash(i: int, salt: str = "") -> str:
    return hashlib.sha256(f"{salt}page{i}".encode()).hexdigest()


def keys_of(h: str):
    return [f"{h}@fp.{c}" for c in COMPONENTS]


def put_page(store, h: str) -> None:
    buf = np.full(OBJ, 7, dtype=np.uint8)
    ok, err = store.put_buffers(keys_of(h), [buf] * len(COMPONENTS), None)
    assert all(ok), err


def new_store(pages: int):
    return _native.Store(
        json.dumps({"dram_capacity_bytes": pages * len(COMPONENTS) * OBJ, "dram_prefault": False})
    )


def wait_for(cond, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def test_event_hash_is_sglangs():
    for i in range(50):
        h = page_hash(i)
        assert event_hash(h) == hash_str_to_int64(h)
    assert page_hash_of_group("tenant/abc@") == "abc"
    assert page_hash_of_group("abc@") == "abc"
    assert event_hash("not-hex-at-all-xyz") is None
    assert event_hash("abc") is None


class Sub:
    """A plain SGLang-style consumer: SUB socket + SGLang's decoder."""

    def __init__(self, endpoint: str, topic: str):
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.connect(endpoint)
        self.sock.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.seqs = []

    def recv(self, timeout_ms=200):
        out = []
        while self.sock.poll(timeout_ms):
            topic, seq, payload = self.sock.recv_multipart()
            self.seqs.append(int.from_bytes(seq, "big"))
            out.extend(self.dec.decode(payload).events)
            timeout_ms = 50
        return out

    def close(self):
        self.sock.close(linger=0)


def test_subscriber_decodes_kvtier_stream_with_sglang_classes():
    store = new_store(pages=4)
    ev = KvEvents(store, publish_endpoint="tcp://127.0.0.1:0", publish_topic="kvtier", poll_ms=5)
    assert ev.endpoint.startswith("tcp://127.0.0.1:") and not ev.endpoint.endswith(":0")
    sub = Sub(ev.endpoint, "kvtier")
    try:
        # ZMQ's slow joiner: store probes until one arrives, then start from a clear.
        i = 0
        while not sub.recv(100):
            put_page(store, page_hash(i, "probe"))
            i += 1
            assert i < 100, "the subscription never became active"
        store.clear()
        wait_for(lambda: any(isinstance(e, AllBlocksCleared) for e in sub.recv(50)), what="clear")

        hashes = [page_hash(i) for i in range(10)]
        for h in hashes:
            put_page(store, h)  # 4 pages fit: 6 evicted whole
        assert store.remove_keys(keys_of(hashes[-1])) == 2
        store.clear()
        got = []
        wait_for(
            lambda: got.extend(sub.recv(50)) or any(isinstance(e, AllBlocksCleared) for e in got),
            what="the second clear",
        )
        stored = [h for e in got if isinstance(e, BlockStored) for h in e.block_hashes]
        removed = [h for e in got if isinstance(e, BlockRemoved) for h in e.block_hashes]
        assert stored == [hash_str_to_int64(h) for h in hashes]
        assert all(isinstance(e, BlockStored) and e.medium == "EXTERNAL" for e in got[:1])
        groups_evicted, groups_now = store.group_stats()
        assert groups_now == 0
        # 6 evictions (the 6 oldest pages, whole) + 1 explicit remove of the newest page.
        assert len(removed) == 7
        assert removed[:6] == [hash_str_to_int64(h) for h in hashes[:6]]
        assert removed[6] == hash_str_to_int64(hashes[-1])
        assert isinstance(got[-1], AllBlocksCleared)
        assert sub.seqs == sorted(sub.seqs) and len(set(sub.seqs)) == len(sub.seqs)
        s = ev.stats()
        assert s["dropped"] == 0 and s["publish_errors"] == 0
        assert s["published_removed"] >= 7 and s["published_cleared"] == 2
        assert groups_evicted >= 6
    finally:
        sub.close()
        ev.stop()


def test_full_ring_drops_are_counted():
    store = new_store(pages=64)
    # A ring of 4 events and a thread that cannot keep up: one drain per 60 s.
    ev = KvEvents(store, publish_endpoint="tcp://127.0.0.1:0", buffer=4, poll_ms=60_000)
    try:
        time.sleep(0.1)  # the thread's first drain (empty) is done; it now sleeps
        for i in range(20):
            put_page(store, page_hash(i))
    finally:
        ev.stop()  # drains the 4 newest, notices 16 dropped
    s = ev.stats()
    assert s["dropped"] == 16 and s["published_stored"] == 4


def test_sglang_publisher_host_removal_keeps_kvtier_page_warm():
    pub = ZmqEventPublisher(attn_dp_rank=0, endpoint="tcp://127.0.0.1:0", bind=True, topic="t")
    endpoint = pub._local_pub_endpoint
    store = new_store(pages=4)
    ev = KvEvents(store, subscribe_endpoint=endpoint, subscribe_topic="t", poll_ms=5)
    try:
        hashes = [page_hash(i) for i in range(6)]
        for h in hashes[:4]:
            put_page(store, h)  # full; hashes[0] is the coldest
        wait_for(lambda: ev.stats()["engine_events"] >= 4, what="kvtier's own stored events")
        n = 0
        while ev.stats()["received_batches"] == 0:  # slow joiner
            pub.publish(KVEventBatch(ts=time.time(), events=[AllBlocksCleared()]))
            time.sleep(0.05)
            n += 1
            assert n < 200, "kvtier never received SGLang's events"
        # The GPU dropped hashes[1] (the host still has it): nothing to do. The host cache
        # dropped hashes[0]: kvtier now holds its only copy and keeps it.
        pub.publish(
            KVEventBatch(
                ts=time.time(),
                events=[
                    BlockRemoved(block_hashes=[hash_str_to_int64(hashes[1])], medium="GPU"),
                    BlockRemoved(
                        block_hashes=[hash_str_to_int64(hashes[0]), 12345], medium="CPU_PINNED"
                    ),
                    BlockStored(
                        block_hashes=[1],
                        parent_block_hash=None,
                        token_ids=[1, 2],
                        block_size=2,
                        lora_id=None,
                        medium="GPU",
                    ),
                ],
            )
        )
        wait_for(lambda: ev.stats()["touched_pages"] == 1, what="the touch")
        s = ev.stats()
        assert s["unknown_hashes"] == 1 and s["received_stored"] == 1
        assert s["received_removed"] == 2 and s["decode_errors"] == 0
        put_page(store, hashes[4])  # evicts the coldest: hashes[1], not the touched hashes[0]
        put_page(store, hashes[5])
        present = [store.exists_keys(keys_of(h)) == [True, True] for h in hashes]
        assert present == [True, False, False, True, True, True]
    finally:
        ev.stop()
        pub.shutdown()


def test_without_the_touch_the_coldest_page_goes():
    # The control of the test above: same puts, no event, hashes[0] is evicted.
    store = new_store(pages=4)
    hashes = [page_hash(i) for i in range(6)]
    for h in hashes:
        put_page(store, h)
    present = [store.exists_keys(keys_of(h)) == [True, True] for h in hashes]
    assert present == [False, False, True, True, True, True]


# -- through SGLang's dynamic backend factory ---------------------------------------------


def _backend(extra):
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    from kvtier_dev.harness.pools import make_storage_config

    cfg = make_storage_config(
        is_mla=True,
        model_name="test/kv-events",
        extra_config={
            "backend_name": "kvtier",
            "module_path": "kvtier.sglang",
            "class_name": "KvtierStore",
            "dram_capacity_bytes": 4 << 20,
            **extra,
        },
    )
    return StorageBackendFactory.create_backend("dynamic", cfg, None)


def test_adapter_starts_and_stops_the_thread():
    b = _backend({"kv_events_publish_endpoint": "tcp://127.0.0.1:0", "kv_events_subscriber": True})
    ev = b._kv_events
    assert ev is not None and ev.endpoint.startswith("tcp://127.0.0.1:")
    assert ev._thread.is_alive()
    b.close()
    assert not ev._thread.is_alive()
    assert _backend({})._kv_events is None


@pytest.mark.parametrize(
    "extra, key",
    [
        ({"kv_events_publish_endpoint": "tcp://127.0.0.1:99999"}, "kv_events_publish_endpoint"),
        ({"kv_events_publish_endpoint": "127.0.0.1:5557"}, "kv_events_publish_endpoint"),
        ({"kv_events_subscriber": True, "kv_events_endpoint": "tcp://"}, "kv_events_endpoint"),
        ({"kv_events_subscriber": "maybe"}, "kv_events_subscriber"),
    ],
)
def test_bad_endpoint_names_the_key(extra, key):
    with pytest.raises(ValueError, match=f"`{key}`"):
        _backend(extra)


def test_port_in_use_names_the_key():
    store = new_store(pages=4)
    ev = KvEvents(store, publish_endpoint="tcp://127.0.0.1:0")
    try:
        with pytest.raises(KvEventsError, match="`kv_events_publish_endpoint`.*cannot bind"):
            KvEvents(new_store(pages=4), publish_endpoint=ev.endpoint)
    finally:
        ev.stop()
