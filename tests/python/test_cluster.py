"""Cluster mode across hosts with SGLang's real host pools.

A real ``kvtier master`` and real ``kvtier serve --master`` nodes, started here on free ports:
node-a on 127.0.0.2 and node-b on 127.0.0.3 stand in for two hosts; the partition test puts a
third node in its own network namespace behind a veth pair the test creates (root only; it
skips, naming itself, where ``ip netns add`` is refused). The SGLang side runs in two separate
processes (_cluster_worker: _server_worker's process, with the store in cluster mode through
``master_address`` / ``node_id`` in extra_config, the token in ``KVTIER_CLUSTER_TOKEN``).

* prefill -> decode: the prefill host writes a DeepSeek-V4-style HostPoolGroup (logical KV
  anchor plus side pools) with the real controller backup flow (batch_set_v2) through node-a,
  and an MLA pool with batch_set_v1; the decode host (node-b, its own pools) gets the same
  batch_exists_v2 answer -- one RPC to the master, counted on the wire -- and reads every page
  byte-exact (sha256 of the page bytes). The puts landed on node-a only (``kvtier inspect`` /
  ``kvtier stat`` on each node's socket, ``kvtier inspect --master``); cache_remote_fetches
  copied what decode read into node-b; the MLA pool's non-writer TP rank writes nothing (one
  copy per cluster); a client requiring ``node_tags`` places on the tagged node.
* node kill: SIGKILL node-a; its pages read as misses within cluster_request_timeout_ms and
  leave exists within the lease; node-b's pages still read byte-exact, the clients keep going.
* partition: the netns node's veth goes down; requests for node-b's pages stay fast and exact,
  the partitioned node's fail within the bound; after the link comes back, it works again.
  That node's client finds its local node by ``node_address`` (no node_id).

``pytest -s`` prints the measured figures.
"""

from __future__ import annotations

import json
import os
import random
import socket as socketlib
import subprocess
import threading
import time
from pathlib import Path

import pytest

import _cluster_worker
import test_server_mode as sm

# The release binary fixture of the server-mode tests (built there when stale).
kvtier_bin = sm.kvtier_bin

TOKEN = "cluster-test-token"
LEASE_MS = 1000
REQUEST_TIMEOUT_MS = 500
# A miss or a failed request may take the request bound plus this much (process and pipe
# overheads on a loaded 2-core machine).
SLACK_S = 0.5


def log(msg):
    print(f"[cluster] {msg}", flush=True)


def free_port(ip="127.0.0.1"):
    with socketlib.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


def _tcp_open(addr):
    host, port = addr.rsplit(":", 1)
    try:
        socketlib.create_connection((host, int(port)), timeout=0.2).close()
        return True
    except OSError:
        return False


# The kind marker of the cluster namespace in a node's store (kvtier-proto namespace.rs).
CLUSTER_MARK = "\x00C"

# ------------------------------------------------------------------------------ processes


class Master:
    """One ``kvtier master`` on a free port; ``extra`` flags are appended (etcd, events, ...)
    and its output goes to ``<log_name>.log``."""

    def __init__(
        self,
        binary,
        tmp_path,
        listen_ip="127.0.0.1",
        reach_ip="127.0.0.1",
        *,
        extra=(),
        log_name="master",
    ):
        port = free_port(listen_ip)
        self.address = f"{reach_ip}:{port}"
        self.binary = binary
        self.log = open(tmp_path / f"{log_name}.log", "w+")
        self.proc = subprocess.Popen(
            [
                str(binary),
                "master",
                "--listen",
                f"{listen_ip}:{port}",
                "--lease-ms",
                str(LEASE_MS),
                *extra,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 20
        while not _tcp_open(self.address):
            assert self.proc.poll() is None, self.output()
            assert time.time() < deadline, "kvtier master did not start"
            time.sleep(0.02)

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stat(self):
        out = subprocess.run(
            [str(self.binary), "stat", "--master", self.address, "--json"],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return json.loads(out.stdout)

    def alive_nodes(self):
        return sorted(n["node_id"] for n in self.stat()["nodes"] if n["alive"])

    def holders(self, keys):
        """Per key (as a node stores it: NUL 'C' tag 0x1f key, the cluster namespace of
        crates/kvtier-proto/src/namespace.rs), the ids of the nodes the directory lists. Asked
        per tag with `inspect --tenant TAG` (a NUL cannot travel in a command's arguments)."""
        by_tag = {}
        for key in keys:
            assert key.startswith(CLUSTER_MARK), f"not a cluster key: {key!r}"
            tag, _, name = key[len(CLUSTER_MARK) :].partition("\x1f")
            by_tag.setdefault(tag, []).append(name)
        held = {}
        for tag, names in by_tag.items():
            out = subprocess.run(
                [str(self.binary), "inspect", "--master", self.address, "--tenant", tag, "--json"]
                + names,
                check=True,
                capture_output=True,
                text=True,
                timeout=30,
            )
            for e in json.loads(out.stdout)["keys"]:
                held[f"{CLUSTER_MARK}{tag}\x1f{e['key']}"] = sorted(
                    n["node_id"] for n in e["nodes"]
                )
        return held

    def wait_nodes(self, want, timeout=15):
        deadline = time.time() + timeout
        while (alive := self.alive_nodes()) != sorted(want):
            assert time.time() < deadline, f"nodes alive {alive}, want {want}:\n{self.output()}"
            time.sleep(0.05)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Node(sm.Served):
    """``kvtier serve --master`` (the server-mode tests' Served, in its own directory).
    ``binary`` may be a wrapper that runs it inside a network namespace."""

    def __init__(self, binary, tmp_path, master_addr, node_id, data_addr, *args, dram="256MiB"):
        self.node_id = node_id
        self.data_addr = data_addr
        d = tmp_path / node_id
        d.mkdir()
        super().__init__(
            binary,
            d,
            "--master",
            master_addr,
            "--data-addr",
            data_addr,
            "--node-id",
            node_id,
            *args,
            dram=dram,
        )

    def keys(self):
        """Every key this node's store holds (``kvtier inspect --prefix ''``)."""
        out = subprocess.run(
            [
                str(self.binary),
                "inspect",
                "--socket",
                self.socket,
                "--prefix",
                "",
                "--raw",
                "--json",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        # Exit 1 with a document: the prefix matched nothing (an empty node), inspect's
        # documented answer; anything else is a failure, shown with inspect's stderr.
        assert out.returncode in (0, 1) and out.stdout.strip(), (
            f"kvtier inspect exit {out.returncode}: {out.stderr[-2000:]}"
        )
        doc = json.loads(out.stdout)
        assert not any(s.get("truncated") for s in doc["stores"]), doc
        keys = sorted(k["key"] for store in doc["stores"] for k in store["prefix"])
        assert (out.returncode == 1) == (not keys), (out.returncode, keys[:4])
        return keys

    def objects(self):
        return sum(s["objects"] for s in self.stat()["stores"].values())

    def sigkill(self):
        self.proc.kill()
        self.proc.wait(10)


class Cluster:
    def __init__(self, binary, tmp_path, **master_kw):
        self.binary, self.tmp_path = binary, tmp_path
        self.master = Master(binary, tmp_path, **master_kw)
        self.nodes: dict[str, Node] = {}

    def add_node(self, node_id, ip, *args, binary=None, port=None, master_addr=None, dram="256MiB"):
        node = Node(
            binary or self.binary,
            self.tmp_path,
            master_addr or self.master.address,
            node_id,
            f"{ip}:{port or free_port(ip)}",
            *args,
            dram=dram,
        )
        self.nodes[node_id] = node
        return node

    def store_config(self, node_id, **extra):
        cfg = dict(
            master_address=self.master.address,
            node_id=node_id,
            cluster_request_timeout_ms=REQUEST_TIMEOUT_MS,
            cluster_master_retry_ms=2000,
        )
        cfg.update(extra)
        return cfg

    def stop(self):
        for n in self.nodes.values():
            started = time.perf_counter()
            n.stop()
            log(f"stopped {n.node_id} in {(time.perf_counter() - started) * 1e3:.0f} ms")
        self.master.stop()


@pytest.fixture
def cluster(kvtier_bin, tmp_path, monkeypatch):
    monkeypatch.setenv("KVTIER_CLUSTER_TOKEN", TOKEN)
    made = []

    def make(**kw):
        c = Cluster(kvtier_bin, tmp_path, **kw)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()


class MasterTap:
    """A TCP relay in front of the master that counts the gRPC calls going through it: each
    call opens one HTTP/2 stream with a HEADERS frame from the client."""

    PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

    def __init__(self, upstream):
        self.upstream = upstream
        self.listener = socketlib.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.calls = 0
        self._lock = threading.Lock()
        self._socks = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            host, port = self.upstream.rsplit(":", 1)
            server = socketlib.create_connection((host, int(port)))
            self._socks += [client, server]
            threading.Thread(target=self._pump, args=(client, server, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()

    def _pump(self, src, dst, count):
        buf = b""
        preface = count
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                data = b""
            if not data:
                for s in (src, dst):
                    try:
                        s.shutdown(socketlib.SHUT_RDWR)
                    except OSError:
                        pass
                return
            if count:
                buf += data
                if preface and len(buf) >= len(self.PREFACE):
                    assert buf.startswith(self.PREFACE)
                    buf, preface = buf[len(self.PREFACE) :], False
                while not preface and len(buf) >= 9:
                    length = int.from_bytes(buf[:3], "big")
                    if len(buf) < 9 + length:
                        break
                    if buf[3] == 0x1:  # HEADERS: a new call
                        with self._lock:
                            self.calls += 1
                    buf = buf[9 + length :]
            try:
                dst.sendall(data)
            except OSError:
                return

    def close(self):
        self.listener.close()
        for s in self._socks:
            s.close()


# ------------------------------------------------------------------------------ SGLang hosts


class Host(sm.Rank):
    """An SGLang host process (_cluster_worker) on the server-mode tests' Rank pipe."""

    def __init__(self):
        self.conn, child = self._ctx.Pipe()
        self.proc = self._ctx.Process(target=_cluster_worker.main, args=(child,), daemon=True)
        self.proc.start()
        child.close()


@pytest.fixture(scope="module")
def _host_pool():
    # Both processes start at once (each pays an SGLang import) and live for the module.
    # Their cluster clients read the token from the environment they start with (issue 26:
    # never from extra_config).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KVTIER_CLUSTER_TOKEN", TOKEN)
        pool = [Host(), Host()]
    for h in pool:  # both import SGLang at once
        h.conn.send(("warm", {}))
    for h in pool:
        assert h.conn.poll(180), "an SGLang host process did not start"
        status, value = h.conn.recv()
        assert status == "ok", value
        log(f"SGLang host process {h.proc.pid} ready in {value:.1f} s")
    yield pool
    for h in pool:
        # Their stores are closed after each test (reset); nothing is left to flush.
        h.proc.kill()
        h.proc.join(10)


@pytest.fixture
def hosts(_host_pool):
    for h in _host_pool:
        if not h.proc.is_alive():
            pytest.fail("an SGLang host process died in an earlier test")
        h("reset")
    yield _host_pool
    for h in _host_pool:
        if h.proc.is_alive():
            try:
                h("reset", timeout=30)
            except Exception:
                h.proc.kill()


def in_parallel(*calls, timeout=120):
    """Run ``(host, command, kwargs)`` calls on their hosts at the same time; their values."""
    for host, name, kwargs in calls:
        host.conn.send((name, kwargs))
    out = []
    for host, name, _ in calls:
        assert host.conn.poll(timeout), f"host call {name} timed out"
        status, value = host.conn.recv()
        assert status == "ok", f"host call {name} failed:\n{value}"
        out.append(value)
    return out


def keys_for(n, tag):
    return [f"{tag}{i:04d}" for i in range(n)]


# ------------------------------------------------------------------------------ tests


def test_prefill_writes_through_its_node_and_decode_reads_byte_exact(cluster, hosts):
    c = cluster()
    a = c.add_node("node-a", "127.0.0.2")
    b = c.add_node("node-b", "127.0.0.3", "--node-tags", "tier-b")
    c.master.wait_nodes(["node-a", "node-b"])
    tap = MasterTap(c.master.address)
    prefill, decode = hosts
    try:
        dsv4 = dict(kind="dsv4", tp_rank=0, tp_size=1, socket=None, allocator="default")
        started = time.perf_counter()
        info, _ = in_parallel(
            (prefill, "setup", {**dsv4, **c.store_config("node-a")}),
            (
                decode,
                "setup",
                {
                    **dsv4,
                    **c.store_config(
                        "node-b", master_address=tap.address, cache_remote_fetches=True
                    ),
                },
            ),
        )
        assert info["mode"] == "cluster"
        log(f"DSV4 pool groups and cluster stores set up in {time.perf_counter() - started:.1f} s")

        keys = keys_for(6, "v4")
        completed, pool_hits, truth, t_put = prefill("v2_backup_hashed", keys=keys, seed=7)
        assert completed == 6 and all(v > 0 for v in pool_hits.values()), pool_hits
        log(
            f"prefill batch_set_v2 of {len(keys)} pages x {len(truth)} side pools: {t_put * 1e3:.1f} ms"
        )

        # Local first: every object went to node-a, none to node-b.
        on_a = a.keys()
        assert len(on_a) > 0 and b.objects() == 0, (on_a, b.stat()["stores"])
        held = c.master.holders(on_a)
        assert set(map(tuple, held.values())) == {("node-a",)}, held
        log(f"after the prefill puts: node-a holds {len(on_a)} objects, node-b 0")

        # The prefill side's own answer, then the decode side's: the same, in one master RPC.
        want = prefill("exists_v2", keys=keys)
        before = tap.calls
        got = decode("exists_v2", keys=keys)
        rpcs = tap.calls - before
        log(
            f"decode batch_exists_v2 ({len(keys)} pages, {len(got[1])} pools): "
            f"{rpcs} master RPC, {got[2] * 1e3:.2f} ms"
        )
        assert got[:2] == want[:2] and got[0] == 6, (got, want)
        assert got[1] and all(v > 0 for v in got[1].values()), got
        assert rpcs == 1, f"batch_exists_v2 took {rpcs} master RPCs"
        assert decode("exists_v2", keys=keys + ["missing"])[0] == 6

        # Decode reads every side pool's pages byte-exact (controller prefetch: batch_get_v2).
        before = tap.calls
        hit, kv_hit, read, t_get = decode("v2_prefetch_hashed", keys=keys)
        log(
            f"decode prefetch (batch_exists_v2 + batch_get_v2): {t_get * 1e3:.1f} ms, "
            f"{tap.calls - before} master RPCs"
        )
        assert hit == kv_hit == 6
        assert read == truth, "decode read different bytes than prefill wrote"

        # cache_remote_fetches: what decode fetched from node-a is now on node-b too.
        on_b = b.keys()
        assert on_b and set(on_b) <= set(on_a), on_b
        held = c.master.holders(on_b)
        assert all(v == ["node-a", "node-b"] for v in held.values()), held
        log(f"cache_remote_fetches: {len(on_b)} of node-a's objects copied into node-b")

        # The v1 path on an MLA pool: prefill (TP rank 0, the storage writer) writes through
        # node-a; decode's TP rank 1 is not the writer (the cluster keeps one copy), reads it.
        prefill("reset")
        decode("reset")
        prefill("setup", kind="mla", tp_rank=0, tp_size=2, socket=None, **c.store_config("node-a"))
        d = decode(
            "setup", kind="mla", tp_rank=1, tp_size=2, socket=None, **c.store_config("node-b")
        )
        assert not d["writes_replicated"]
        mla = keys_for(8, "mla")
        a_before, b_before = a.objects(), b.objects()
        ok, written, _ = prefill("v1_write_hashed", keys=mla, seed=3)
        assert ok == [True] * 8
        assert a.objects() - a_before == 8 and b.objects() == b_before
        assert decode("v1_write_hashed", keys=mla, seed=99)[0] == [True] * 8  # a no-op
        assert b.objects() == b_before
        ok, data, t_v1 = decode("v1_read_hashed", keys=mla)
        assert ok == [True] * 8 and data == written
        assert decode("v1_exists_timed", keys=mla + ["gone"])[0] == 8
        log(f"MLA batch_get_v1 of 8 pages from node-a: {t_v1 * 1e3:.1f} ms")

        # node_tags: a prefill client on node-a that requires tag tier-b places on node-b.
        prefill("reset")
        prefill(
            "setup",
            kind="mha",
            tp_rank=0,
            tp_size=1,
            socket=None,
            **c.store_config("node-a", node_tags="tier-b"),
        )
        a_before, b_before = a.objects(), b.objects()
        ok, written, _ = prefill("v1_write_hashed", keys=keys_for(4, "tagged"), seed=5)
        assert ok == [True] * 4
        assert (a.objects() - a_before, b.objects() - b_before) == (0, 8)
        decode("reset")
        decode("setup", kind="mha", tp_rank=0, tp_size=1, socket=None, **c.store_config("node-b"))
        ok, data, _ = decode("v1_read_hashed", keys=keys_for(4, "tagged"))
        assert ok == [True] * 4 and data == written
        log("node_tags=tier-b: the node-a client's 4 MHA pages (8 objects) went to node-b")
    finally:
        tap.close()


def test_killed_node_pages_become_misses_within_the_bound(cluster, hosts):
    c = cluster()
    a = c.add_node("node-a", "127.0.0.2")
    c.add_node("node-b", "127.0.0.3")
    c.master.wait_nodes(["node-a", "node-b"])
    prefill, decode = hosts
    prefill("setup", kind="mha", tp_rank=0, tp_size=1, socket=None, **c.store_config("node-a"))
    decode("setup", kind="mha", tp_rank=0, tp_size=1, socket=None, **c.store_config("node-b"))
    on_a, on_b = keys_for(8, "ka"), keys_for(8, "kb")
    ok, written_a, _ = prefill("v1_write_hashed", keys=on_a, seed=1)
    assert ok == [True] * 8
    ok, written_b, _ = decode("v1_write_hashed", keys=on_b, seed=2)
    assert ok == [True] * 8
    ok, data, _ = decode("v1_read_hashed", keys=on_a)
    assert ok == [True] * 8 and data == written_a  # warm: decode has connections to node-a

    a.sigkill()
    killed = time.perf_counter()
    ok, _, t_get = decode("v1_read_hashed", keys=on_a)
    log(
        f"get of 8 pages on the killed node: all missed in {t_get * 1e3:.1f} ms "
        f"(bound {REQUEST_TIMEOUT_MS} ms)"
    )
    assert ok == [False] * 8, "pages of a dead node were served"
    assert t_get < REQUEST_TIMEOUT_MS / 1e3 + SLACK_S
    ok, data, t_b = decode("v1_read_hashed", keys=on_b)
    assert ok == [True] * 8 and data == written_b
    log(f"node-b's pages meanwhile: byte-exact in {t_b * 1e3:.1f} ms")

    # exists: the directory drops node-a when its lease lapses.
    worst = 0.0
    while True:
        hit, t_exists = decode("v1_exists_timed", keys=on_a)
        worst = max(worst, t_exists)
        if hit == 0:
            break
        assert time.perf_counter() - killed < LEASE_MS / 1e3 + 3, "node-a never left the directory"
        time.sleep(0.05)
    gone = time.perf_counter() - killed
    log(
        f"exists of node-a's pages: a miss {gone * 1e3:.0f} ms after the kill (lease {LEASE_MS} ms), "
        f"slowest exists call {worst * 1e3:.1f} ms"
    )
    assert worst < REQUEST_TIMEOUT_MS / 1e3 + SLACK_S
    assert decode("v1_exists_timed", keys=on_b)[0] == 8

    # The client whose own node died keeps working: its puts go to node-b now.
    fresh = keys_for(4, "after")
    ok, written, t_put = prefill("v1_write_hashed", keys=fresh, seed=5)
    assert ok == [True] * 4, "puts after a node death"
    ok, data, _ = decode("v1_read_hashed", keys=fresh)
    assert ok == [True] * 4 and data == written
    assert c.master.alive_nodes() == ["node-b"]
    log(f"puts from node-a's client after the kill: on node-b, {t_put * 1e3:.1f} ms")


# ------------------------------------------------------------------------------ netns


class Netns:
    """A network namespace joined to the host by a veth pair (host side .1, netns side .2 of
    a /24 picked at random); removed by ``remove`` (a finalizer calls it)."""

    def __init__(self):
        tag = f"{os.getpid() % 100000}{random.randrange(100):02d}"
        self.name = f"kvtier-test-{tag}"
        self.host_if, self.ns_if = f"kvh{tag}", f"kvn{tag}"
        self.net = f"10.77.{random.randrange(1, 250)}"
        self.host_ip, self.ns_ip = f"{self.net}.1", f"{self.net}.2"
        self.created = False

    def run(self, *args, ns=False):
        cmd = ["ip", "netns", "exec", self.name, *args] if ns else list(args)
        return subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=10)

    def create(self):
        self.run("ip", "netns", "add", self.name)
        self.created = True
        self.run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        self.run("ip", "link", "set", self.ns_if, "netns", self.name)
        self.run("ip", "addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
        self.run("ip", "link", "set", self.host_if, "up")
        self.run("ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if, ns=True)
        self.run("ip", "link", "set", self.ns_if, "up", ns=True)
        self.run("ip", "link", "set", "lo", "up", ns=True)

    def link(self, up):
        self.run("ip", "link", "set", self.ns_if, "up" if up else "down", ns=True)

    def wrapper(self, binary, directory: Path):
        """A script that runs ``binary`` inside the namespace (exec: same pid)."""
        path = directory / "kvtier-in-netns"
        path.write_text(f'#!/bin/sh\nexec ip netns exec {self.name} {binary} "$@"\n')
        path.chmod(0o755)
        return path

    def remove(self):
        if not self.created:
            return
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=10)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=10)
        self.created = False


@pytest.fixture
def netns(request):
    ns = Netns()
    request.addfinalizer(ns.remove)
    try:
        ns.create()
    except (subprocess.CalledProcessError, FileNotFoundError) as e:
        ns.remove()
        detail = getattr(e, "stderr", "") or str(e)
        pytest.skip(
            "test_partitioned_netns_node_does_not_block_the_others needs network namespaces "
            f"(root and iproute2): `ip netns add` failed: {detail.strip()}"
        )
    return ns


def test_partitioned_netns_node_does_not_block_the_others(netns, cluster, hosts, tmp_path):
    # (netns first: it is torn down last, after the processes inside it have stopped.)
    # Master on every host address (reached at 127.0.0.1 from the host, at the veth's host
    # side from the namespace), node-b on the host, node-c inside the namespace.
    c = cluster(listen_ip="0.0.0.0")
    port = int(c.master.address.rsplit(":", 1)[1])
    c.add_node("node-b", "127.0.0.3")
    node_c = c.add_node(
        "node-c",
        netns.ns_ip,
        binary=netns.wrapper(c.binary, tmp_path),
        port=7811,
        master_addr=f"{netns.host_ip}:{port}",
    )
    c.master.wait_nodes(["node-b", "node-c"])
    log(f"netns {netns.name}: node-c at {node_c.data_addr}, veth {netns.host_if}/{netns.ns_if}")
    writer_c, decode = hosts
    # node-c's client names its node by data address (node_address) instead of node_id.
    writer_c(
        "setup",
        kind="mha",
        tp_rank=0,
        tp_size=1,
        socket=None,
        **c.store_config(None, node_address=node_c.data_addr),
    )
    decode("setup", kind="mha", tp_rank=0, tp_size=1, socket=None, **c.store_config("node-b"))
    on_c, on_b = keys_for(8, "pc"), keys_for(8, "pb")
    ok, written_c, _ = writer_c("v1_write_hashed", keys=on_c, seed=1)
    assert ok == [True] * 8
    assert node_c.objects() == 16  # 8 pages x (k, v), through the veth
    ok, written_b, _ = decode("v1_write_hashed", keys=on_b, seed=2)
    assert ok == [True] * 8
    ok, data, t_c = decode("v1_read_hashed", keys=on_c)
    assert ok == [True] * 8 and data == written_c
    log(f"decode read node-c's 8 pages over the veth: {t_c * 1e3:.1f} ms")

    netns.link(False)
    cut = time.perf_counter()
    try:
        ok, data, t_b = decode("v1_read_hashed", keys=on_b)
        assert ok == [True] * 8 and data == written_b
        ok, _, t_c = decode("v1_read_hashed", keys=on_c)
        log(
            f"partitioned: node-b's pages exact in {t_b * 1e3:.1f} ms; node-c's pages "
            f"{ok.count(False)}/8 failed in {t_c * 1e3:.1f} ms (bound {REQUEST_TIMEOUT_MS} ms)"
        )
        assert t_b < 0.25, "a partitioned node slowed reads of the others"
        assert ok == [False] * 8
        assert t_c < REQUEST_TIMEOUT_MS / 1e3 + SLACK_S
        # The master drops node-c when its lease lapses; node-b keeps taking puts meanwhile.
        fresh = keys_for(4, "mid")
        ok, written_mid, t_put = decode("v1_write_hashed", keys=fresh, seed=3)
        assert ok == [True] * 4 and t_put < 0.25, t_put
        deadline = time.time() + LEASE_MS / 1e3 + 3
        while decode("v1_exists_timed", keys=on_c)[0] != 0:
            assert time.time() < deadline, "node-c never left the directory"
            time.sleep(0.05)
        log(f"node-c left the directory {(time.perf_counter() - cut) * 1e3:.0f} ms after the cut")
        hit, t_exists = decode("v1_exists_timed", keys=on_b)
        assert hit == 8 and t_exists < 0.25
    finally:
        netns.link(True)
    healed = time.perf_counter()
    c.master.wait_nodes(["node-b", "node-c"])
    log(f"healed: node-c alive again after {(time.perf_counter() - healed) * 1e3:.0f} ms")
    # Writes through node-c work again and read back exact from the host side.
    c_before = node_c.objects()
    again = keys_for(4, "healed")
    deadline = time.time() + 5
    while True:
        ok, written, _ = writer_c("v1_write_hashed", keys=again, seed=4)
        if ok == [True] * 4 or time.time() > deadline:
            break
        time.sleep(0.1)
    assert ok == [True] * 4
    assert node_c.objects() - c_before == 8, "the healed node's client did not write locally"
    ok, data, t_c = decode("v1_read_hashed", keys=again)
    assert ok == [True] * 4 and data == written
    ok, data, _ = decode("v1_read_hashed", keys=on_b + fresh)
    assert ok == [True] * 12 and data == written_b + written_mid
    log(f"after healing: node-c's new pages read exact in {t_c * 1e3:.1f} ms")
    ok, data, _ = decode("v1_read_hashed", keys=on_c)
    log(f"after healing: {ok.count(True)}/8 of node-c's pages from before the cut are found again")
    assert data == written_c or ok != [True] * 8
