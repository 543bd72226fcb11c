"""The host KV-event stream of ``kvtier serve`` (issue 30) against the engines' own decoders.

Real parts: a real ``kvtier serve`` with ``--host-events-endpoint`` / ``--host-events-replay-
endpoint`` on 127.0.0.1 (port 0), real clients in server mode, pyzmq (libzmq) SUB and DEALER
sockets speaking to kvtier's PUB and ROUTER, and both engines' msgspec ``KVEventBatch``
decoders (vLLM 0.34's and SGLang 0.5.23's). The vLLM case runs vLLM's scheduler and
connector (as test_vllm_tier) on the server, and compares the stream's hashes with the
engine's own GPU events for the same tokens. Hostile peers (a wrong greeting, an oversized
frame, too many connections, a subscriber that never reads) play against the real server;
the legitimate subscriber keeps receiving every batch.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import time

import msgspec
import numpy as np
import pytest
import zmq

import _vllm_engine as ve
import test_server_mode as sm

kvtier_bin = sm.kvtier_bin

OBJ = 64 * 1024
COMPONENTS = ("k", "v")  # two objects per SGLang page: one group


def page_hash(i: int, salt: str = "") -> str:
    return hashlib.sha256(f"{salt}host-page{i}".encode()).hexdigest()


def sglang_keys(h: str) -> list[str]:
    return [f"{h}@0123456789ab.{c}" for c in COMPONENTS]


def put_pages(store, hashes) -> None:
    keys = [k for h in hashes for k in sglang_keys(h)]
    buf = np.full(OBJ, 3, dtype=np.uint8)
    ok, err = store.put_buffers(keys, [buf] * len(keys), None)
    assert all(ok), err


def held_pages(store, hashes) -> set[str]:
    """Pages kvtier holds (a page group exists while any of its objects does)."""
    n = len(COMPONENTS)
    found = store.exists_keys([k for h in hashes for k in sglang_keys(h)])
    return {h for i, h in enumerate(hashes) if any(found[i * n : (i + 1) * n])}


def serve(kvtier_bin, tmp_path, *args, dram="1MiB"):
    return sm.Served(
        kvtier_bin,
        tmp_path,
        "--engine",
        f"dram_block_size={OBJ}",
        "--host-events-endpoint",
        "tcp://127.0.0.1:0",
        "--host-events-replay-endpoint",
        "tcp://127.0.0.1:0",
        *args,
        dram=dram,
    )


def endpoints(served):
    doc = served.stat()["server"]["host_events"]
    return doc["endpoint"], doc["replay_endpoint"]


def client(served):
    from kvtier import _native

    return _native.Store(json.dumps({"server_socket": served.socket}))


def replay_batches(ctx, endpoint, start):
    """vLLM's replay protocol, as a router speaks it: the start sequence (8 bytes, big-endian)
    to the ROUTER; the buffered raw batches from it by sequence, then the end marker (sequence
    -1, empty topic and payload)."""
    d = ctx.socket(zmq.DEALER)
    try:
        d.connect(endpoint)
        d.send_multipart((b"", start.to_bytes(8, "big")))
        out = {}
        for _ in range(100_000):
            assert d.poll(5000), "no end marker from the replay socket"
            empty, topic, seq, payload = d.recv_multipart()
            assert empty == b""
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert payload == b""
                return out
            out[int.from_bytes(seq, "big")] = payload
        raise AssertionError("replay did not end")
    finally:
        d.close(linger=0)


class Router:
    """A router's end: SUB for the live stream, DEALER replay; raw batches kept by sequence."""

    def __init__(self, endpoint, replay):
        self.ctx = zmq.Context.instance()
        self.endpoint, self.replay_ep = endpoint, replay
        self.live: dict[int, bytes] = {}
        self.sub = None
        self.connect()

    def connect(self):
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(self.endpoint)
        time.sleep(0.3)  # the subscription reaches the publisher

    def disconnect(self):
        self.sub.close(linger=0)
        self.sub = None

    def receive(self, timeout=1.0):
        while self.sub.poll(int(timeout * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == b""
            self.live[int.from_bytes(seq, "big")] = payload
            timeout = 0.3

    def replay(self, start):
        return replay_batches(self.ctx, self.replay_ep, start)

    def snapshot(self, prefix: bytes):
        """kvtier's snapshot request on the replay socket: ``(seq, batch)`` or None (nothing
        published yet), after which the end marker must come."""
        d = self.ctx.socket(zmq.DEALER)
        try:
            d.connect(self.replay_ep)
            d.send_multipart((b"", b"SNAPSHOT", prefix))
            assert d.poll(5000), "no snapshot answer"
            parts = d.recv_multipart()
            if parts[2] == (-1).to_bytes(8, "big", signed=True):
                return None
            _, topic, seq, payload = parts
            assert d.poll(5000), "no end marker after the snapshot"
            assert d.recv_multipart()[2] == (-1).to_bytes(8, "big", signed=True)
            return int.from_bytes(seq, "big"), payload
        finally:
            d.close(linger=0)

    def close(self):
        if self.sub is not None:
            self.disconnect()


def decoders():
    from sglang.srt.disaggregation.kv_events import KVEventBatch as SGLangBatch
    from vllm.distributed.kv_events import KVEventBatch as VllmBatch

    return msgspec.msgpack.Decoder(type=VllmBatch), msgspec.msgpack.Decoder(type=SGLangBatch)


class Credit:
    """What a router believes the host holds: event hash -> reference count."""

    def __init__(self):
        self.count: dict[int, int] = {}

    def apply(self, batch):
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                self.count.clear()
                continue
            for h in ev.block_hashes:
                if kind == "BlockStored":
                    self.count[h] = self.count.get(h, 0) + 1
                else:
                    assert self.count.get(h, 0) > 0, f"removal of {h} never stored"
                    self.count[h] -= 1
                    if not self.count[h]:
                        del self.count[h]

    def held(self) -> set[int]:
        return set(self.count)


def test_host_stream_with_both_engines_decoders_replay_and_gaps(kvtier_bin, tmp_path):
    from sglang.srt.mem_cache.utils import hash_str_to_int64
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvtier import _native

    vdec, sdec = decoders()
    served = serve(kvtier_bin, tmp_path)
    router = None
    try:
        pub, rep = endpoints(served)
        assert pub.startswith("tcp://127.0.0.1:") and not pub.endswith(":0")
        router = Router(pub, rep)
        store = client(served)
        pages = [page_hash(i) for i in range(4)]
        put_pages(store, pages)
        # A vLLM block (its key scheme) and a key of no engine's scheme.
        block = hashlib.sha256(b"vllm-block").digest()
        vkey = _native.key_vllm("vllm/m_0123456789abcdef", block, 2)
        ok, err = store.put_buffers([vkey, "opaque-key"], [np.zeros(OBJ, np.uint8)] * 2, None)
        assert all(ok), err
        router.receive()
        assert router.live, "no batch on the live stream"
        stored_s, stored_v = [], []
        for seq in sorted(router.live):
            for ev in sdec.decode(router.live[seq]).events:
                if type(ev).__name__ == "BlockStored":
                    stored_s.extend(ev.block_hashes)
            for ev in vdec.decode(router.live[seq]).events:
                if type(ev).__name__ == "BlockStored":
                    assert ev.medium == "CPU" and ev.ownership.startswith("kvtier:")
                    stored_v.extend((h, ev.group_idx) for h in ev.block_hashes)
        # SGLang's hash of each page (one event per page, not per component) ...
        want_pages = {hash_str_to_int64(h) for h in pages}
        assert want_pages <= set(stored_s) and len(stored_s) == 5
        # ... and vLLM's of the block, with its KV group; the opaque key is only counted.
        assert (maybe_convert_block_hash(block), 2) in stored_v
        doc = served.stat()["server"]["host_events"]
        assert doc["unmapped"] >= 1 and doc["published_stored"] == 5

        # kvtier's own evictions: 16 more pages into a 16-object store (8 pages).
        more = [page_hash(i, "more") for i in range(16)]
        for i in range(0, 16, 4):
            put_pages(store, more[i : i + 4])
        router.receive()
        credit = Credit()
        for seq in sorted(router.live):
            credit.apply(sdec.decode(router.live[seq]))
        truth = {hash_str_to_int64(h) for h in held_pages(store, pages + more)}
        assert credit.held() - {maybe_convert_block_hash(block)} == truth
        assert len(truth) < 20, "nothing was evicted"

        # A router that disconnects, misses batches and reconnects: replay from its last
        # sequence + 1 returns exactly the missed batches, in order, then the end marker.
        last = max(router.live)
        router.disconnect()
        put_pages(store, [page_hash(i, "missed") for i in range(4)])
        time.sleep(0.5)
        router.connect()
        missed = router.replay(last + 1)
        assert missed and sorted(missed) == list(range(last + 1, last + 1 + len(missed)))
        for payload in missed.values():
            credit.apply(sdec.decode(payload))
        put_pages(store, [page_hash(i, "after") for i in range(2)])
        router.receive()
        newer = sorted(s for s in router.live if s > last)
        assert newer and newer[0] == last + 1 + len(missed), "a gap after the replay"
        for seq in newer:
            credit.apply(sdec.decode(router.live[seq]))
        everything = pages + more + [page_hash(i, s) for s in ("missed", "after") for i in range(4)]
        truth = {hash_str_to_int64(h) for h in held_pages(store, everything)}
        assert credit.held() - {maybe_convert_block_hash(block)} == truth

        # Replay from 0 is the whole stream, byte for byte what was published live.
        whole = router.replay(0)
        assert sorted(whole) == list(range(len(whole)))
        assert all(whole[s] == router.live[s] for s in router.live)
    finally:
        if router is not None:
            router.close()
        served.stop()


def raw_peer(endpoint: str) -> socket.socket:
    host, port = endpoint[len("tcp://") :].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def closed_by_server(s: socket.socket, timeout=6.0) -> bool:
    s.settimeout(timeout)
    try:
        while True:
            data = s.recv(4096)
            if not data:
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def zmtp_greeting() -> bytes:
    return b"\xff" + b"\0" * 8 + b"\x7f" + b"\x03\x00" + b"NULL" + b"\0" * 16 + b"\0" + b"\0" * 31


def raw_subscriber(endpoint: str) -> socket.socket:
    """A ZMTP SUB peer by hand (subscribed to everything) that will never read again."""
    s = raw_peer(endpoint)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 2048)
    s.sendall(zmtp_greeting())
    got = b""
    while len(got) < 64:
        got += s.recv(64 - len(got))
    props = b"\x0bSocket-Type" + (3).to_bytes(4, "big") + b"SUB"
    body = b"\x05READY" + props
    s.sendall(bytes([0x04, len(body)]) + body)
    s.sendall(b"\x00\x01\x01")  # the subscription message: 0x01 + empty prefix
    return s


def test_hostile_peers_are_bounded_and_subscribers_still_served(kvtier_bin, tmp_path, monkeypatch):
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    monkeypatch.setenv("KVTIER_SERVE_HOST_EVENTS_MAX_SUBSCRIBERS", "3")
    monkeypatch.setenv("KVTIER_SERVE_HOST_EVENTS_SUBSCRIBER_QUEUE", "2")
    _, sdec = decoders()
    served = serve(kvtier_bin, tmp_path, dram="64MiB")
    router = stalled = None
    peers = []
    try:
        pub, rep = endpoints(served)
        # A peer that is not ZMTP, and one whose first frame claims 1 GiB: closed.
        junk = raw_peer(pub)
        junk.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64)
        assert closed_by_server(junk)
        huge = raw_peer(rep)
        huge.sendall(zmtp_greeting())
        huge.sendall(b"\x06" + (1 << 30).to_bytes(8, "big"))
        assert closed_by_server(huge)
        # The legitimate router, then a subscriber that never reads: whatever it holds up
        # (its own queue of 2 batches, then its socket), the router gets every batch.
        router = Router(pub, rep)
        stalled = raw_subscriber(pub)
        # A third connection (silent) fills the bound of 3; a fourth is closed at once.
        peers.append(raw_peer(pub))
        time.sleep(0.2)
        extra = raw_peer(pub)
        assert closed_by_server(extra, timeout=3)
        store = client(served)
        hashes = []
        for r in range(40):
            batch = [page_hash(i, f"r{r}") for i in range(8)]
            put_pages(store, batch)
            hashes += batch
            time.sleep(0.06)  # about one batch per round
        router.receive()
        seqs = sorted(router.live)
        assert seqs == list(range(len(seqs))), "the router lost batches"
        got = set()
        for s in seqs:
            for ev in sdec.decode(router.live[s]).events:
                got.update(ev.block_hashes)
        assert got == {hash_str_to_int64(h) for h in hashes}
        doc = served.stat()["server"]["host_events"]
        assert doc["refused"] >= 1 and doc["bad_peers"] >= 2, doc
        assert doc["subscribers_total"] >= 2, doc
    finally:
        for p in peers:
            p.close()
        if stalled is not None:
            stalled.close()
        if router is not None:
            router.close()
        served.stop()


@pytest.mark.parametrize(
    "args,key",
    [
        (["--host-events-endpoint", "127.0.0.1:5557"], "host_events_endpoint"),
        (["--host-events-endpoint", "tcp://localhost:5557"], "host_events_endpoint"),
        (
            ["--host-events-replay-endpoint", "tcp://127.0.0.1:0"],
            "host_events_replay_endpoint",
        ),
    ],
)
def test_bad_endpoints_fail_naming_the_key(kvtier_bin, tmp_path, args, key):
    out = subprocess.run(
        [str(kvtier_bin), "serve", "--socket", str(tmp_path / "s.sock"), *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out
    assert key in out.stderr


def test_vllm_blocks_on_the_host_stream_carry_vllms_own_hashes(kvtier_bin, tmp_path):
    """vLLM's scheduler and connector store a prompt through a ``kvtier serve``: the host stream
    names each block with the hash vLLM's own (GPU) events use for the same tokens."""
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from test_vllm_tier import FULL_BLOCKS, PROMPT, TIER

    ve.remove_leftover_regions()
    served = serve(kvtier_bin, tmp_path, dram="64MiB")
    router = v = None
    try:
        router = Router(*endpoints(served))
        v = ve.VllmInstance(tmp_path, [dict(TIER, server_socket=served.socket)])
        req, _ = v.run(PROMPT)
        router.receive()
        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        got = [
            (h, ev.group_idx)
            for s in sorted(router.live)
            for ev in dec.decode(router.live[s]).events
            if type(ev).__name__ == "BlockStored"
            for h in ev.block_hashes
        ]
        want = [(maybe_convert_block_hash(h), 0) for h in req.block_hashes[:FULL_BLOCKS]]
        assert sorted(got) == sorted(want)
    finally:
        if v is not None:
            v.close()
        if router is not None:
            router.close()
        served.stop()
        ve.remove_leftover_regions()


def test_late_router_takes_a_snapshot_of_one_namespace(kvtier_bin, tmp_path):
    """A router that joins late asks for a snapshot of one vLLM model namespace: exactly the
    blocks of that namespace kvtier holds, then the live stream from the snapshot's sequence
    on keeps it exact (explicit removes and new stores included)."""
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from kvtier import _native

    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    served = serve(kvtier_bin, tmp_path, dram="64MiB")
    router = None
    try:
        store = client(served)
        ns_a, ns_b = "vllm/model-a_00000000000000aa", "vllm/model-b_00000000000000bb"
        blocks = [hashlib.sha256(b"blk%d" % i).digest() for i in range(12)]

        def keys(ns, bs):
            return [_native.key_vllm(ns, b, 0) for b in bs]

        def put(ks):
            ok, err = store.put_buffers(ks, [np.zeros(OBJ, np.uint8)] * len(ks), None)
            assert all(ok), err

        put(keys(ns_a, blocks[:8]) + keys(ns_b, blocks[8:]))
        put_pages(store, [page_hash(i) for i in range(3)])
        store.remove_keys(keys(ns_a, blocks[:2]))  # explicit removes: gone from the snapshot
        time.sleep(0.3)  # the stream's next rounds
        router = Router(*endpoints(served))
        snap = router.snapshot((ns_a + "/").encode())
        assert snap is not None
        seq, payload = snap
        batch = dec.decode(payload)
        kinds = [type(e).__name__ for e in batch.events]
        assert kinds[0] == "AllBlocksCleared" and set(kinds[1:]) <= {"BlockStored"}
        held = {h for e in batch.events[1:] for h in e.block_hashes}

        def truth():
            found = store.exists_keys(keys(ns_a, blocks[:8]))
            return {maybe_convert_block_hash(b) for b, f in zip(blocks[:8], found) if f}

        assert held == truth() and len(held) == 6
        # The live stream from the snapshot on: what was published after it, then new changes.
        store.remove_keys(keys(ns_a, blocks[2:4]))
        put(keys(ns_a, [hashlib.sha256(b"new%d" % i).digest() for i in range(2)]))
        router.receive()
        later = router.replay(seq + 1)
        assert sorted(later) == list(range(seq + 1, seq + 1 + len(later)))
        new = {maybe_convert_block_hash(hashlib.sha256(b"new%d" % i).digest()) for i in range(2)}
        for s_ in sorted(later):
            for e in dec.decode(later[s_]).events:
                name = type(e).__name__
                if name == "BlockStored":
                    held |= set(e.block_hashes)  # only model a changed since
                elif name == "BlockRemoved":
                    held -= set(e.block_hashes)
        assert held == truth() | new
        # The empty prefix is everything held: the 3 SGLang pages and model b's blocks too.
        everything = dec.decode(router.snapshot(b"")[1]).events
        assert sum(len(e.block_hashes) for e in everything[1:]) == 3 + 4 + 4 + 2
        assert served.stat()["server"]["host_events"]["snapshots"] == 2
    finally:
        if router is not None:
            router.close()
        served.stop()
