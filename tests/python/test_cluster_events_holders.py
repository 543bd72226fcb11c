"""The cluster KV-event stream names every holder of a block (issue 30): vLLM blocks written
through node-a of a real replicated cluster appear on the master's stream with the hashes
vLLM's own events carry, once per node holding a copy; a node's death is a ``BlockRemoved``
for that node and the copy re-replication makes is a ``BlockStored`` for the new holder.

Real parts: one real ``kvtier master --default-replication 2`` with ``--events-endpoint`` /
``--events-replay-endpoint`` on 127.0.0.1, three real ``kvtier serve --master`` nodes
(node-a/b/c on 127.0.0.2/3/4, standing in for three hosts), vLLM 0.34's scheduler and
OffloadingConnector with kvtier's tier in cluster mode through node-a and vLLM's own
``ZmqEventPublisher`` (as in test_vllm_tier_events; substituted, no GPU: the worker's copy and
the model forward), pyzmq SUB/DEALER on the master's endpoints, vLLM's msgspec decoder. The
oracle is kvtier itself: which node holds a block is read from each live node's store
(``kvtier inspect --socket``), never from the stream.
"""

from __future__ import annotations

import time

import msgspec
import pytest

import _vllm_engine as ve
import test_cluster as tc
import test_host_events as he
import test_server_mode as sm
from test_vllm_tier import FULL_BLOCKS, PROMPT, TIER
from test_vllm_tier_events import Subscriber, events_of, hashes

# The tier tests' autouse fixture: no leftover shared-memory regions.
from test_vllm_tier import _no_leftover_regions  # noqa: F401

kvtier_bin = sm.kvtier_bin

NODES = (("node-a", "127.0.0.2"), ("node-b", "127.0.0.3"), ("node-c", "127.0.0.4"))


class ReplicatingMaster(tc.Master):
    """One ``kvtier master`` (no etcd: it leads at once) keeping two copies of every object,
    with the cluster KV-event stream on free 127.0.0.1 ports."""

    def __init__(self, binary, tmp_path):
        self.events = f"tcp://127.0.0.1:{tc.free_port()}"
        self.replay = f"tcp://127.0.0.1:{tc.free_port()}"
        super().__init__(
            binary,
            tmp_path,
            extra=(
                "--default-replication",
                "2",
                "--events-endpoint",
                self.events,
                "--events-replay-endpoint",
                self.replay,
            ),
        )


class Holders:
    """A router's view of the cluster stream: block hash -> the nodes credited with a copy
    (each ``ownership`` is one residency, as vLLM's tracker counts them)."""

    def __init__(self):
        self.held: dict[int, set[str]] = {}
        self.stored: list[tuple[int, str]] = []
        self.removed: list[tuple[int, str]] = []

    def apply(self, batch):
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                self.held.clear()
                continue
            assert ev.medium is None, "the master knows the node, not its tier"
            node = ev.ownership.removeprefix("kvtier:")
            for h in ev.block_hashes:
                nodes = self.held.setdefault(h, set())
                if kind == "BlockStored":
                    assert node not in nodes, f"{h} credited to {node} twice"
                    nodes.add(node)
                    self.stored.append((h, node))
                else:
                    assert node in nodes, f"{h} removed from {node}, never stored there"
                    nodes.discard(node)
                    self.removed.append((h, node))
                if not nodes:
                    del self.held[h]


def view(router, dec):
    """The master's stream so far, applied in sequence order (no batch missing)."""
    seqs = sorted(router.live)
    assert seqs == list(range(seqs[0], seqs[-1] + 1)) if seqs else True, "lost batches"
    v = Holders()
    for seq in seqs:
        v.apply(dec.decode(router.live[seq]))
    return v


def truth(nodes, want):
    """Event hash -> the live nodes whose store holds that vLLM block (its hash hex in a key)."""
    held: dict[int, set[str]] = {}
    for node_id, node in nodes.items():
        keys = node.keys()
        for h, hex_ in want.items():
            if any(hex_ in k for k in keys):
                held.setdefault(h, set()).add(node_id)
    return held


def converge(router, dec, nodes, want, timeout=20):
    """Wait until the stream's holders equal what the live nodes hold, two copies each."""
    deadline = time.time() + timeout
    while True:
        router.receive(timeout=0.5)
        v, t = view(router, dec), truth(nodes, want)
        if v.held == t and set(t) == set(want) and all(len(n) == 2 for n in t.values()):
            return v
        assert time.time() < deadline, f"stream {v.held} vs nodes {t}"


def test_vllm_blocks_through_node_a_and_their_rereplication(kvtier_bin, tmp_path, monkeypatch):
    from vllm.distributed.kv_events import KVEventBatch
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    monkeypatch.setenv("KVTIER_CLUSTER_TOKEN", tc.TOKEN)
    dec = msgspec.msgpack.Decoder(type=KVEventBatch)
    started = time.perf_counter()
    master = ReplicatingMaster(kvtier_bin, tmp_path)
    nodes: dict[str, tc.Node] = {}
    router = sub = v = None
    try:
        for node_id, ip in NODES:
            nodes[node_id] = tc.Node(
                kvtier_bin, tmp_path, master.address, node_id, f"{ip}:{tc.free_port(ip)}"
            )
        master.wait_nodes([n for n, _ in NODES])
        router = he.Router(master.events, master.replay)
        tc.log(f"master and three nodes up in {time.perf_counter() - started:.1f} s")

        # vLLM's scheduler and connector store a prompt's blocks through node-a; vLLM's own
        # publisher carries its GPU events (and the tier's) to `sub`.
        sub = Subscriber()
        cfg = dict(
            master_address=master.address,
            node_id="node-a",
            cluster_request_timeout_ms=tc.REQUEST_TIMEOUT_MS,
            cluster_master_retry_ms=2000,
        )
        v = ve.VllmInstance(tmp_path, [dict(TIER, **cfg)], kv_events=sub.config())
        assert v.tier._store.mode == "cluster"
        sub.connect()
        req, _ = v.run(PROMPT)
        for _ in range(3):
            v.step()
        sub.receive()
        blocks = req.block_hashes[:FULL_BLOCKS]
        want = {maybe_convert_block_hash(h): bytes(h).hex() for h in blocks}
        # The engine's own events name these blocks with these numbers.
        assert set(want) <= set(hashes(events_of(sub.live, "BlockStored", medium="GPU")))
        assert set(want) <= set(hashes(events_of(sub.live, "BlockStored", ownership="KvtierTier")))

        # The master's stream: every block once per node holding a copy (node-a and one more).
        got = converge(router, dec, nodes, want)
        assert all("node-a" in n for n in got.held.values()), got.held
        assert sorted(h for h, _ in got.stored) == sorted(h for h in want for _ in range(2))
        # A late router's snapshot of vLLM's namespace says the same.
        seq, payload = router.snapshot(b"vllm/")
        snap = Holders()
        snap.apply(dec.decode(payload))
        assert seq == max(router.live) and snap.held == got.held
        tc.log(f"blocks on the stream with both holders {time.perf_counter() - started:.1f} s")

        # node-a dies: its copies are BlockRemoved for node-a, and the copies re-replication
        # makes on the third node are BlockStored for that node.
        before = {h: set(n) for h, n in got.held.items()}
        killed = time.perf_counter()
        nodes.pop("node-a").sigkill()
        got = converge(router, dec, nodes, want)
        tc.log(
            f"holders repaired on the stream {time.perf_counter() - killed:.1f} s after the kill"
        )
        assert all("node-a" not in n for n in got.held.values())
        removed_a = [h for h, n in got.removed if n == "node-a"]
        assert sorted(removed_a) == sorted(want)
        new_copies = [(h, n) for h, n in got.stored[2 * len(want) :]]
        assert sorted(new_copies) == sorted(
            (h, n) for h in want for n in got.held[h] - before[h]
        ), (new_copies, before, got.held)
        assert len(new_copies) == len(want), "one new holder per block"
        tc.log(f"whole test {time.perf_counter() - started:.1f} s")
    finally:
        if v is not None:
            v.close()
        if sub is not None:
            sub.close()
        if router is not None:
            router.close()
        for n in nodes.values():
            n.stop()
        master.stop()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
