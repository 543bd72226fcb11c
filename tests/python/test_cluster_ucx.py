"""The UCX data plane (issue 17) under SGLang's real DeepSeek-V4 pool group.

A real ``kvtier master`` and two real ``kvtier serve --master`` nodes (node-a on 127.0.0.2,
node-b on 127.0.0.3, both with ``--engine cluster_transport=ucx``), started as test_cluster.py
starts them. Two SGLang host processes (_cluster_worker, the harness's DSV4 HostPoolGroup:
logical KV anchor plus side pools): the prefill host writes a span with the real controller
backup flow (batch_set_v2) through its node-a client; the decode host, a client of node-b with
``cluster_transport = "ucx"``, reads every page of every side pool back (batch_exists_v2 +
batch_get_v2) and compares it byte for byte (sha256) with what was written.

It runs twice, UCX pinned to TCP on loopback (``UCX_TLS=tcp UCX_NET_DEVICES=lo``) and to shared
memory (``UCX_TLS=posix,cma,self``), the two settings of crates/kvtier-cli/tests/cluster_ucx.rs.
The nodes inherit the variables from this process; the host processes set them before their
store (and so their UCX context) is created. The test cannot pass on frames: the decode
client's stats (``peer_transports``) must name ``ucx`` for node-a after the reads (a UCX
failure falls back to frames and reports ``tcp`` there), with the UCX_TLS both sides used;
and node-a's ``/metrics`` must show no page bytes sent over its TCP frames during the reads.
The prefill host's batch_set_v2 travels over UCX too (one-sided puts into node-a's landing
area): node-a's frame counter shows no page byte coming in, its ``kvtier stat`` data plane
counts one UCX put per object, and the prefill client names ``ucx`` for its puts.
Both hosts register every physical buffer of the DSV4 pools with UCX (``ucx_registered_regions``
equals the registry's regions; one region refused through the test-only
``TEST_KVTIER_UCX_REFUSE_REGION`` is counted once in ``ucx_registration_failures``), their
transfers pass those memory handles, and the decode client names the transports UCX negotiated
for node-a's endpoint (``ucx_lanes``: tcp lanes, or a shared-memory one).
Issue 26: UCX's tcp and posix lanes emulate one-sided access in software and would serve any
peer's read or write, so kvtier refuses them unless the INSECURE test hook
``TEST_INSECURE_UCX_EMULATED_RMA=1`` is set; the two protocol runs set it (nodes and hosts),
as no RDMA lane exists here. ``test_default_refuses_emulated_ucx_and_frames_serve_byte_exact``
runs the same group with ``UCX_TLS=tcp`` and no hook: both nodes and both hosts refuse UCX
(saying why), and decode reads every page byte-exact over frames.
It skips, naming itself, where libucp cannot be loaded. Under shared memory UCX logs one
"no active messages transport ... no peer failure handler" error: the endpoint is asked for
with peer failure handling first, which UCX's shm transports lack, then made without it
(``Worker::connect`` in transport/ucx/plane.rs); expected.
"""

from __future__ import annotations

import ctypes
import time
import urllib.request

import pytest

import test_cluster as tc
from test_cluster import _host_pool, cluster, hosts, kvtier_bin  # noqa: F401  (fixtures)

HOOK = "TEST_INSECURE_UCX_EMULATED_RMA"
TRANSPORTS = {
    "tcp": {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", HOOK: "1"},
    "shm": {"UCX_TLS": "posix,cma,self", "UCX_NET_DEVICES": "lo", HOOK: "1"},
}
PAGES = 6


def peer_bytes(metrics_addr):
    """Page bytes a node moved, by direction (its ``/metrics``:
    ``kvtier_peer_transfer_bytes_total``, summed over peers): frames and one-sided UCX."""
    with urllib.request.urlopen(f"http://{metrics_addr}/metrics", timeout=10) as r:
        text = r.read().decode()
    moved = {"in": 0.0, "out": 0.0}
    for line in text.splitlines():
        if line.startswith("kvtier_peer_transfer_bytes_total{"):
            labels, value = line.rsplit(" ", 1)
            for d in moved:
                if f'direction="{d}"' in labels:
                    moved[d] += float(value)
    return moved


def frame_bytes(metrics_addr, node):
    """Page bytes ``node`` moved over its TCP frames: :func:`peer_bytes` less what its UCX
    data plane counted (committed one-sided puts in, released one-sided reads out)."""
    moved = peer_bytes(metrics_addr)
    plane = node.stat()["data_plane"]
    return {
        "in": moved["in"] - plane["landed_bytes_total"],
        "out": moved["out"] - plane["released_bytes_total"],
    }


def _libucp_missing():
    for name in ("libucp.so.0", "libucp.so"):
        try:
            ctypes.CDLL(name)
            return None
        except OSError as e:
            reason = str(e)
    return reason


@pytest.mark.parametrize("transport", sorted(TRANSPORTS))
def test_dsv4_group_read_byte_exact_through_another_node_over_ucx(
    transport, cluster, hosts, monkeypatch
):
    missing = _libucp_missing()
    if missing:
        pytest.skip(f"test_cluster_ucx needs libucp (UCX): {missing}")
    env = TRANSPORTS[transport]
    for k, v in env.items():
        monkeypatch.setenv(k, v)  # inherited by the nodes
    started = time.perf_counter()
    c = cluster()
    metrics_a = f"127.0.0.2:{tc.free_port('127.0.0.2')}"
    a = c.add_node(
        "node-a", "127.0.0.2", "--engine", "cluster_transport=ucx", "--metrics-addr", metrics_a
    )
    b = c.add_node("node-b", "127.0.0.3", "--engine", "cluster_transport=ucx")
    c.master.wait_nodes(["node-a", "node-b"])
    prefill, decode = hosts
    # The decode host refuses one region's UCX registration (test-only hook) to show a
    # refusal is counted, once.
    refuse = {"TEST_KVTIER_UCX_REFUSE_REGION": "refuse-me"}
    tc.in_parallel(
        (prefill, "set_env", {"env": env}), (decode, "set_env", {"env": {**env, **refuse}})
    )
    dsv4 = dict(kind="dsv4", tp_rank=0, tp_size=1, socket=None, allocator="default")
    ucx = dict(cluster_transport="ucx", cluster_request_timeout_ms=2000)
    info, _ = tc.in_parallel(
        (prefill, "setup", {**dsv4, **c.store_config("node-a", **ucx)}),
        (decode, "setup", {**dsv4, **c.store_config("node-b", **ucx)}),
    )
    assert info["mode"] == "cluster"
    # Every physical buffer of every DSV4 pool the adapter registered is registered with UCX.
    for host in (prefill, decode):
        regions, registered, failures, _ = host("ucx_regions")
        assert regions > 0 and registered == regions and failures == 0, (
            regions,
            registered,
            failures,
        )
    decode("register_scratch", label="refuse-me")
    regions, registered, failures, _ = decode("ucx_regions")
    assert (registered, failures) == (regions - 1, 1), (regions, registered, failures)
    tc.log(f"[{transport}] cluster and DSV4 stores up in {time.perf_counter() - started:.1f} s")

    keys = tc.keys_for(PAGES, f"ucx-{transport}-")
    completed, pool_hits, truth, t_put = prefill("v2_backup_hashed", keys=keys, seed=17)
    assert completed == PAGES and all(v > 0 for v in pool_hits.values()), pool_hits
    assert truth and all(truth.values()), truth
    # Written through node-a only: node-b holds nothing, so every page decode reads is remote.
    on_a = a.keys()
    assert on_a and b.objects() == 0, (on_a, b.stat()["stores"])

    # The puts went one-sided into node-a's landing area: no page byte came in as a frame,
    # its landing counters moved, and the prefill client names UCX for its puts to node-a.
    before = frame_bytes(metrics_a, a)
    assert before["in"] == 0, f"node-a received the puts over frames: {before}"
    plane = a.stat()["data_plane"]
    assert plane["ucx_puts"] == len(on_a) and plane["ucx_put_bytes"] > 0, plane
    assert plane["reservations_held"] == 0 and plane["commits_refused_checksum"] == 0, plane
    wrote = {p["peer"]: p for p in prefill("stats_json").get("peer_transports", [])}
    assert wrote[a.data_addr]["puts"] == "ucx", wrote

    hit, kv_hit, read, t_get = decode("v2_prefetch_hashed", keys=keys)
    assert hit == kv_hit == PAGES, (hit, kv_hit)
    assert read == truth, "decode read different bytes than prefill wrote"
    pages = sum(len(p) for p in read.values())
    assert b.objects() == 0, "the reads copied objects into node-b"

    stats = decode("stats_json")
    peers = {p["peer"]: p for p in stats.get("peer_transports", [])}
    assert a.data_addr in peers, f"no transport reported for node-a {a.data_addr}: {stats}"
    used = peers[a.data_addr]
    assert used["transport"] == "ucx", f"node-a was read over frames: {used}"
    assert used["ucx_lanes"], used
    shm = ("posix/", "cma/", "sysv/")
    if transport == "tcp":
        assert all(lane.startswith("tcp/") for lane in used["ucx_lanes"]), used
    else:
        assert any(lane.startswith(shm) for lane in used["ucx_lanes"]), used
    for host in (prefill, decode):
        assert host("ucx_regions")[3] > 0, "no transfer used a registered pool buffer"
    tls = env["UCX_TLS"]
    assert f"node UCX_TLS {tls}" in used["reason"] and f"here {tls}" in used["reason"], used
    # And node-a sent no page bytes over its frames for those reads: every page went one-sided
    # (an object the node cannot lease is read over frames without changing peer_transports).
    after = frame_bytes(metrics_a, a)
    assert after["out"] == before["out"], f"node-a served page bytes over frames: {after}"
    # The node counted the one-sided reads as bytes out (on each lease's release).
    released = a.stat()["data_plane"]["released_bytes_total"]
    assert released >= pages and peer_bytes(metrics_a)["out"] >= released, released
    tc.log(
        f"[{transport}] batch_set_v2 of {PAGES} pages via node-a over UCX {t_put * 1e3:.1f} ms; "
        f"decode read {pages} side-pool pages from node-a byte-exact in {t_get * 1e3:.1f} ms "
        f"over {used['transport']} ({used['reason']})"
    )


def test_default_refuses_emulated_ucx_and_frames_serve_byte_exact(cluster, hosts, monkeypatch):
    missing = _libucp_missing()
    if missing:
        pytest.skip(f"test_cluster_ucx needs libucp (UCX): {missing}")
    env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo", HOOK: None}
    for k, v in env.items():
        if v is None:
            monkeypatch.delenv(k, raising=False)
        else:
            monkeypatch.setenv(k, v)  # inherited by the nodes
    c = cluster()
    a = c.add_node("node-a", "127.0.0.2", "--engine", "cluster_transport=ucx")
    b = c.add_node("node-b", "127.0.0.3", "--engine", "cluster_transport=ucx")
    c.master.wait_nodes(["node-a", "node-b"])
    for node in (a, b):
        plane = node.stat()["data_plane"]
        assert plane["transport"] == "frames" and "UCX refused" in plane["reason"], plane
    prefill, decode = hosts
    tc.in_parallel((prefill, "set_env", {"env": env}), (decode, "set_env", {"env": env}))
    dsv4 = dict(kind="dsv4", tp_rank=0, tp_size=1, socket=None, allocator="default")
    ucx = dict(cluster_transport="ucx", cluster_request_timeout_ms=2000)
    tc.in_parallel(
        (prefill, "setup", {**dsv4, **c.store_config("node-a", **ucx)}),
        (decode, "setup", {**dsv4, **c.store_config("node-b", **ucx)}),
    )
    keys = tc.keys_for(PAGES, "ucx-refused-")
    completed, _, truth, _ = prefill("v2_backup_hashed", keys=keys, seed=23)
    assert completed == PAGES and truth and all(truth.values()), truth
    assert b.objects() == 0
    hit, kv_hit, read, _ = decode("v2_prefetch_hashed", keys=keys)
    assert hit == kv_hit == PAGES, (hit, kv_hit)
    assert read == truth, "decode read different bytes than prefill wrote"
    for host in (prefill, decode):
        peers = {p["peer"]: p for p in host("stats_json").get("peer_transports", [])}
        used = peers[a.data_addr]
        assert used["transport"] == "tcp" and "UCX refused" in used["reason"], used
        assert used["ucx_lanes"] == [], used
