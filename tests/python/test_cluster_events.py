"""The cluster KV-event stream of ``kvtier master`` (issue 30 part 3) across a leader failover.

Real parts: a real etcd (/usr/bin/etcd, on free 127.0.0.1 ports in a temporary directory), two
real ``kvtier master --etcd`` with ``--events-endpoint`` / ``--events-replay-endpoint`` on
127.0.0.1, two real ``kvtier serve --master`` nodes (node-a on 127.0.0.2, node-b on
127.0.0.3), SGLang's real host pools and controller backup flow writing through node-a (the
_cluster_worker process of test_cluster.py), pyzmq (libzmq) SUB and DEALER sockets on each
master's endpoints, and vLLM 0.34's msgspec ``KVEventBatch`` decoder. The expected hashes are
SGLang's own (``hash_str_to_int64`` of each page hash, what SGLang's radix cache publishes).

What it shows: hostile peers on the master's endpoints are closed or bounded while the
router keeps every batch; the leader's stream carries one ``BlockStored`` per SGLang page (whatever its
pools and components) with SGLang's hash and ``ownership`` naming node-a, the follower's
stream carries nothing; a snapshot answers the same set; a clear (delete) removes every
block; a SIGKILLed leader's successor starts its stream with ``AllBlocksCleared`` and then
the blocks the nodes re-register (a router can tell the failover from a gap), and node-a's
death removes its blocks from the new leader's stream.
"""

from __future__ import annotations

import hashlib
import json
import socket
import subprocess
import time

import msgspec
import pytest

import test_cluster as tc
import test_host_events as he
from chaos_soak import Etcd  # a real etcd on free loopback ports

kvtier_bin = tc.kvtier_bin


class EventMaster(tc.Master):
    """``kvtier master --etcd`` with the cluster KV-event stream on free 127.0.0.1 ports."""

    def __init__(self, binary, tmp_path, etcd, name):
        self.events = f"tcp://127.0.0.1:{tc.free_port()}"
        self.replay = f"tcp://127.0.0.1:{tc.free_port()}"
        super().__init__(
            binary,
            tmp_path,
            extra=(
                "--etcd",
                etcd.endpoint,
                "--election-ttl-s",
                "2",
                "--events-endpoint",
                self.events,
                "--events-replay-endpoint",
                self.replay,
            ),
            log_name=name,
        )

    def leads(self):
        out = subprocess.run(
            [str(self.binary), "stat", "--master", self.address, "--json"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.returncode == 0 and json.loads(out.stdout).get("is_leader") is True

    def sigkill(self):
        self.proc.kill()
        self.proc.wait(10)


def wait_leader(masters, timeout=20):
    deadline = time.time() + timeout
    while True:
        leading = [m for m in masters if m.proc.poll() is None and m.leads()]
        if len(leading) == 1:
            return leading[0]
        assert time.time() < deadline, f"{len(leading)} leaders"
        time.sleep(0.1)


def decode_all(dec, router):
    """The router's live batches in sequence order, decoded with vLLM's types."""
    return [(seq, dec.decode(router.live[seq])) for seq in sorted(router.live)]


def blocks(batches, kind):
    """(hash, ownership) of every block of events of `kind` in `batches`."""
    return [
        (h, ev.ownership)
        for _, b in batches
        for ev in b.events
        if type(ev).__name__ == kind
        for h in ev.block_hashes
    ]


def receive_until(router, dec, done, timeout=15):
    deadline = time.time() + timeout
    while True:
        router.receive(timeout=0.5)
        batches = decode_all(dec, router)
        if done(batches):
            return batches
        assert time.time() < deadline, f"stream did not get there: {batches}"


def page_hashes(n, salt):
    return [hashlib.sha256(f"{salt}-{i}".encode()).hexdigest() for i in range(n)]


@pytest.fixture
def host(tc_host_pool):
    h = tc_host_pool[0]
    h("reset")
    yield h
    if h.proc.is_alive():
        h("reset", timeout=30)


@pytest.fixture(scope="module")
def tc_host_pool():
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTIER_CLUSTER_TOKEN", tc.TOKEN)
        pool = [tc.Host()]
    pool[0].conn.send(("warm", {}))
    assert pool[0].conn.poll(180), "the SGLang host process did not start"
    status, value = pool[0].conn.recv()
    assert status == "ok", value
    tc.log(f"SGLang host process ready in {value:.1f} s")
    yield pool
    pool[0].proc.kill()
    pool[0].proc.join(10)


def test_cluster_stream_follows_the_leader(kvtier_bin, tmp_path, monkeypatch, host):
    from sglang.srt.mem_cache.utils import hash_str_to_int64
    from vllm.distributed.kv_events import KVEventBatch

    if not socket.gethostbyname("localhost").startswith("127."):
        pytest.skip("localhost is not on 127.0.0.0/8")
    monkeypatch.setenv("KVTIER_CLUSTER_TOKEN", tc.TOKEN)
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    started = time.perf_counter()
    etcd = Etcd(tmp_path)
    masters, nodes, routers = [], [], {}
    try:
        masters = [EventMaster(kvtier_bin, tmp_path, etcd, f"master{i}") for i in range(2)]
        leader = wait_leader(masters)
        follower = next(m for m in masters if m is not leader)
        for m in masters:
            routers[m.address] = he.Router(m.events, m.replay)
        master_list = ",".join(m.address for m in masters)
        for node_id, ip in (("node-a", "127.0.0.2"), ("node-b", "127.0.0.3")):
            nodes.append(
                tc.Node(kvtier_bin, tmp_path, master_list, node_id, f"{ip}:{tc.free_port(ip)}")
            )
        leader.wait_nodes(["node-a", "node-b"])
        tc.log(f"etcd, two masters, two nodes up in {time.perf_counter() - started:.1f} s")

        cfg = dict(
            master_address=master_list,
            node_id="node-a",
            cluster_request_timeout_ms=tc.REQUEST_TIMEOUT_MS,
            cluster_master_retry_ms=2000,
        )
        dsv4 = dict(kind="dsv4", tp_rank=0, tp_size=1, socket=None, allocator="default")
        assert host("setup", **dsv4, **cfg)["mode"] == "cluster"
        pages = page_hashes(6, "first")
        completed, pool_hits, _, _ = host("v2_backup_hashed", keys=pages, seed=3)
        assert completed == 6 and all(v > 0 for v in pool_hits.values()), pool_hits
        want = {hash_str_to_int64(p) for p in pages}

        # The leader's stream: one BlockStored per page with SGLang's hash, owned by node-a.
        lr = routers[leader.address]
        batches = receive_until(lr, dec, lambda b: len(blocks(b, "BlockStored")) >= 6)
        stored = blocks(batches, "BlockStored")
        assert sorted(h for h, _ in stored) == sorted(want), stored
        assert {o for _, o in stored} == {"kvtier:node-a"}
        # The master knows which node holds a block, not on which of its tiers: nil medium.
        assert all(
            ev.medium is None for _, b in batches for ev in b.events if hasattr(ev, "medium")
        )
        # Its stream began with the reset of its election (replayed from 0).
        first = dec.decode(lr.replay(0)[0])
        assert type(first.events[0]).__name__ == "AllBlocksCleared"
        # The snapshot says the same.
        seq, payload = lr.snapshot(b"")
        snap = dec.decode(payload)
        assert seq == max(lr.live) and type(snap.events[0]).__name__ == "AllBlocksCleared"
        assert sorted(h for h, _ in blocks([(seq, snap)], "BlockStored")) == sorted(want)
        assert {o for _, o in blocks([(seq, snap)], "BlockStored")} == {"kvtier:node-a"}
        # The follower's snapshot: nothing published, nothing held.
        assert routers[follower.address].snapshot(b"") is None
        # The follower publishes nothing.
        routers[follower.address].receive(timeout=0.5)
        assert routers[follower.address].live == {}

        # Hostile peers on the master's endpoints: not ZMTP, a frame claiming 1 GiB (closed),
        # a subscriber that never reads (held in its own bounded queue): the router below
        # still gets every batch.
        junk = he.raw_peer(leader.events)
        junk.sendall(b"GET / HTTP/1.1\r\n\r\n" + b"x" * 64)
        assert he.closed_by_server(junk)
        huge = he.raw_peer(leader.replay)
        huge.sendall(he.zmtp_greeting())
        huge.sendall(b"\x06" + (1 << 30).to_bytes(8, "big"))
        assert he.closed_by_server(huge)
        stalled = he.raw_subscriber(leader.events)

        # A delete (SGLang's clear: Forget through the master) removes every block.
        assert host("clear") is True
        batches = receive_until(lr, dec, lambda b: len(blocks(b, "BlockRemoved")) >= 6)
        assert sorted(h for h, _ in blocks(batches, "BlockRemoved")) == sorted(want)
        credit = he.Credit()
        for _, b in batches:
            credit.apply(b)
        assert credit.held() == set()
        assert sorted(lr.live) == list(range(min(lr.live), max(lr.live) + 1)), "lost batches"
        stalled.close()

        # Pages to survive the failover on node-a.
        pages2 = page_hashes(4, "second")
        completed, _, _, _ = host("v2_backup_hashed", keys=pages2, seed=5)
        assert completed == 4
        want2 = {hash_str_to_int64(p) for p in pages2}
        receive_until(lr, dec, lambda b: len(blocks(b, "BlockStored")) >= 10)
        host("reset")

        # SIGKILL the leader: the follower's stream starts with a reset, then node-a's pages.
        killed = time.perf_counter()
        leader.sigkill()
        new = wait_leader([follower])
        fr = routers[follower.address]
        batches = receive_until(fr, dec, lambda b: len(blocks(b, "BlockStored")) >= 4)
        tc.log(
            f"new leader's stream has node-a's pages {time.perf_counter() - killed:.1f} s after the kill"
        )
        assert new is follower
        assert type(batches[0][1].events[0]).__name__ == "AllBlocksCleared", batches[0]
        credit = he.Credit()
        for _, b in batches:
            credit.apply(b)
        assert credit.held() == want2
        assert {o for _, o in blocks(batches, "BlockStored")} == {"kvtier:node-a"}

        # node-a dies: its lease lapses and its pages leave the new leader's stream.
        nodes[0].sigkill()
        batches = receive_until(fr, dec, lambda b: len(blocks(b, "BlockRemoved")) >= 4)
        removed = blocks(batches, "BlockRemoved")
        assert sorted(h for h, _ in removed) == sorted(want2)
        assert {o for _, o in removed} == {"kvtier:node-a"}
        tc.log(f"whole test {time.perf_counter() - started:.1f} s")
    finally:
        for r in routers.values():
            r.close()
        for n in nodes:
            n.stop()
        for m in masters:
            m.stop()
        etcd.stop()


@pytest.mark.parametrize(
    "args, named",
    [
        (["--events-endpoint", "127.0.0.1:5557"], "--events-endpoint"),
        (["--events-endpoint", "tcp://localhost:5557"], "--events-endpoint"),
        (["--events-replay-endpoint", "tcp://127.0.0.1:5558"], "--events-replay-endpoint"),
        (
            ["--events-endpoint", "tcp://127.0.0.1:0", "--events-max-blocks", "0"],
            "--events-max-blocks",
        ),
    ],
)
def test_bad_event_flags_fail_naming_the_flag(kvtier_bin, args, named):
    """Only IP literals are bound (nothing listens where the operator did not say)."""
    out = subprocess.run(
        [str(kvtier_bin), "master", "--listen", "127.0.0.1:0", *args],
        capture_output=True,
        text=True,
        timeout=30,
        env={"KVTIER_CLUSTER_TOKEN": tc.TOKEN, "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode != 0 and named in out.stderr, out.stderr
