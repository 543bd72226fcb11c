"""Server mode end to end: a real ``kvtier serve`` process started by the test, and SGLang's
real host pools in two separate client processes (two "TP ranks") against it.

Covers byte-exact v1 round trips (zero copy from SGLang's own ShmHostTensorAllocator memfds,
and the staging-ring fallback for the default allocator), the legacy tensor path, a v2 round
trip through the real controller flows on the DeepSeek-V4 pool group, MLA dedup across ranks
(rank 0 writes, rank 1 reads, one copy stored), a client SIGKILLed in the middle of a batch
(the server keeps serving the other rank and leaks no mapping), a pointer outside registered
memory, ``kvtier stat``, and graceful SIGTERM shutdown.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import shutil
import signal
import socket as socketlib
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest

import _server_worker
import kvtier

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("KVTIER_SERVER_BIN", ROOT / "target" / "release" / "kvtier"))


@pytest.fixture(scope="session")
def kvtier_bin():
    """The release ``kvtier`` binary, built here when cargo is available (a no-op when fresh)."""
    if shutil.which("cargo") and "KVTIER_SERVER_BIN" not in os.environ:
        subprocess.run(
            ["cargo", "build", "--release", "-q", "-p", "kvtier-cli"],
            cwd=ROOT,
            check=True,
        )
    assert BIN.exists(), f"{BIN} is missing: run cargo build --release -p kvtier-cli"
    return BIN


def _connectable(path: str) -> bool:
    s = socketlib.socket(socketlib.AF_UNIX, socketlib.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


class Served:
    def __init__(self, binary, tmp_path, *args, dram="256MiB"):
        self.socket = str(tmp_path / "kvtier.sock")
        self.log = open(tmp_path / "serve.log", "w+")
        self.proc = subprocess.Popen(
            [
                str(binary),
                "serve",
                "--socket",
                self.socket,
                "--dram-capacity",
                dram,
                "--engine",
                "dram_prefault=false",
                *args,
            ],
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 30
        while not _connectable(self.socket):
            assert self.proc.poll() is None, self.output()
            assert time.time() < deadline, "kvtier serve did not start"
            time.sleep(0.02)
        self.binary = binary

    def output(self):
        self.log.flush()
        self.log.seek(0)
        return self.log.read()

    def stat(self):
        out = subprocess.run(
            [str(self.binary), "stat", "--socket", self.socket, "--json"],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
        return json.loads(out.stdout)

    def wait_for(self, what, cond, timeout=20):
        deadline = time.time() + timeout
        while True:
            doc = self.stat()
            if cond(doc):
                return doc
            assert time.time() < deadline, f"timed out waiting for {what}: {doc['server']}"
            time.sleep(0.05)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture
def served(kvtier_bin, tmp_path):
    s = Served(kvtier_bin, tmp_path)
    yield s
    s.stop()


class Rank:
    """A client process (one TP rank) running _server_worker.main."""

    _ctx = mp.get_context("spawn")

    def __init__(self):
        self.conn, child = self._ctx.Pipe()
        self.proc = self._ctx.Process(target=_server_worker.main, args=(child,), daemon=True)
        self.proc.start()
        child.close()

    def __call__(self, name, timeout=120, **kwargs):
        self.conn.send((name, kwargs))
        if not self.conn.poll(timeout):
            raise TimeoutError(f"rank call {name} timed out")
        status, value = self.conn.recv()
        if status != "ok":
            raise AssertionError(f"rank call {name} failed:\n{value}")
        return value

    def kill(self):
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.join(10)

    def close(self):
        if self.proc.is_alive():
            try:
                self("exit", timeout=10)
            except Exception:
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                self.proc.kill()


@pytest.fixture(scope="module")
def _rank_pool():
    """Rank processes live for the whole module (spawning one costs an SGLang import); each
    test sets up fresh pools and a fresh store in them."""
    pool = []
    yield pool
    for r in pool:
        r.close()


@pytest.fixture
def ranks(_rank_pool):
    def make(n=2):
        _rank_pool[:] = [r for r in _rank_pool if r.proc.is_alive()]
        while len(_rank_pool) < n:
            _rank_pool.append(Rank())
        out = _rank_pool[:n]
        for r in out:
            r("reset")
        return out

    yield make
    for r in list(_rank_pool):
        if r.proc.is_alive():
            try:
                r("reset", timeout=30)
            except Exception:
                r.proc.kill()


def keys_for(n, tag):
    return [f"{tag}{i:04d}" for i in range(n)]


def main_store(doc):
    return doc["stores"]["main"]


# ------------------------------------------------------------------------------ v1


@pytest.mark.parametrize("allocator", ["shm", "default"])
def test_mha_v1_round_trips_byte_exact_across_two_ranks(served, ranks, allocator):
    r0, r1 = ranks()
    info0 = r0("setup", kind="mha", tp_rank=0, tp_size=2, socket=served.socket, allocator=allocator)
    info1 = r1("setup", kind="mha", tp_rank=1, tp_size=2, socket=served.socket, allocator=allocator)
    assert info0["mode"] == info1["mode"] == "server"
    if allocator == "shm":
        # SGLang's own memfds went to the server: zero copy.
        assert info0["zero_copy_regions"] >= 1 and info1["zero_copy_regions"] >= 1
    else:
        assert info0["zero_copy_regions"] == 0  # plain anonymous memory: staging ring
    keys = keys_for(8, "mha")
    ok0, w0 = r0("v1_write", keys=keys, seed=11)
    ok1, w1 = r1("v1_write", keys=keys, seed=22)
    assert ok0 == ok1 == [True] * 8
    assert w0 != w1  # each TP rank has its own shard under its own keys
    got0, d0 = r0("v1_read", keys=keys)
    got1, d1 = r1("v1_read", keys=keys)
    assert got0 == got1 == [True] * 8
    assert d0 == w0 and d1 == w1
    assert r1("v1_exists", keys=keys + ["missing"]) == 8
    doc = served.stat()
    assert main_store(doc)["objects"] == 2 * 8 * 2  # 2 ranks x 8 pages x (k, v)
    assert doc["server"]["sessions"] == 2
    stats = r0("stats")
    if allocator == "shm":
        assert stats["zero_copy_bytes"] > 0 and stats["staged_bytes"] == 0
    else:
        assert stats["staged_bytes"] > 0 and stats["zero_copy_bytes"] == 0


def test_legacy_tensor_path_round_trips_through_the_server(served, ranks):
    (r0,) = ranks(1)
    r0("setup", kind="mha", tp_rank=0, tp_size=1, socket=served.socket, allocator="shm", v1=False)
    keys = keys_for(4, "legacy")
    ok, written = r0("v1_write", keys=keys, seed=5)
    assert ok == [True] * 4
    got, data = r0("v1_read", keys=keys)
    assert got == [True] * 4 and data == written


def test_mla_kv_is_stored_once_per_host(served, ranks):
    r0, r1 = ranks()
    i0 = r0("setup", kind="mla", tp_rank=0, tp_size=2, socket=served.socket)
    i1 = r1("setup", kind="mla", tp_rank=1, tp_size=2, socket=served.socket)
    assert i0["writes_replicated"] and not i1["writes_replicated"]
    keys = keys_for(6, "mla")
    ok0, written = r0("v1_write", keys=keys, seed=3)
    # Rank 1 is not the storage writer: it reports success and writes nothing.
    ok1, _ = r1("v1_write", keys=keys, seed=99)
    assert ok0 == ok1 == [True] * 6
    got, data = r1("v1_read", keys=keys)
    assert got == [True] * 6 and data == written, "rank 1 reads rank 0's object"
    doc = served.stat()
    assert main_store(doc)["objects"] == 6, "one copy per page for the whole host"
    put_by_session = {s["pid"]: s["pages_put"] for s in doc["sessions"]}
    assert put_by_session[i1["pid"]] == 0 and put_by_session[i0["pid"]] == 6


# ------------------------------------------------------------------------------ v2


def test_dsv4_v2_round_trip_through_the_controller_flows(served, ranks):
    r0, r1 = ranks()
    r0("setup", kind="dsv4", tp_rank=0, tp_size=2, socket=served.socket, allocator="default")
    r1("setup", kind="dsv4", tp_rank=1, tp_size=2, socket=served.socket, allocator="default")
    keys = keys_for(6, "v4")
    completed, pool_hits, truth = r0("v2_backup", keys=keys, seed=7)
    assert completed == 6 and all(v > 0 for v in pool_hits.values()), pool_hits
    hit, kv_hit, got = r1("v2_prefetch", keys=keys)
    assert hit == kv_hit == 6
    assert set(got) == set(truth)
    for pool, pages in truth.items():
        assert got[pool] == pages, pool  # byte exact, restored by the other rank


# ------------------------------------------------------------------------------ faults


def test_sigkill_during_a_batch_leaves_the_server_serving_and_no_mapping(served, ranks):
    victim, survivor = ranks()
    vi = victim("setup", kind="mha", tp_rank=0, tp_size=2, socket=served.socket, allocator="shm")
    survivor("setup", kind="mha", tp_rank=1, tp_size=2, socket=served.socket, allocator="shm")
    keys = keys_for(8, "s")
    ok, written = survivor("v1_write", keys=keys, seed=1)
    assert ok == [True] * 8
    before = served.stat()
    maps_before = before["server"]["live_mappings"]
    victim.conn.send(("spin", {"keys": keys_for(16, "victim"), "seed": 2}))
    assert victim.conn.recv() == ("ok", "spinning")
    served.wait_for(
        "the victim to be mid-stream",
        lambda d: any(s["pid"] == vi["pid"] and s["pages_put"] > 64 for s in d["sessions"]),
    )
    victim.kill()
    doc = served.wait_for(
        "the victim's session and mappings to go",
        lambda d: (
            d["server"]["sessions"] == 1
            and d["server"]["live_mappings"] < maps_before
            and all(s["pid"] != vi["pid"] for s in d["sessions"])
        ),
    )
    assert doc["server"]["mapped_bytes"] == doc["sessions"][0]["mapped_bytes"]
    # No pinned leftovers: every allocated block belongs to a visible object (4 KiB blocks).
    st = main_store(doc)
    assert st["bytes_allocated"] <= st["bytes_used"] + 4096 * st["objects"], st
    # The other rank is served as before.
    got, data = survivor("v1_read", keys=keys)
    assert got == [True] * 8 and data == written
    ok, _ = survivor("v1_write", keys=keys_for(4, "after"), seed=3)
    assert ok == [True] * 4


def test_pointer_outside_registered_memory_fails_that_key_clearly(served, ranks):
    (r0,) = ranks(1)
    r0("setup", kind="mha", tp_rank=0, tp_size=1, socket=served.socket)
    ok, errors = r0("raw_put_outside", size=4096)
    assert ok == [False]
    assert any("outside every registered memory region" in e for e in errors), errors
    # Server and session alive.
    keys = keys_for(2, "alive")
    assert r0("v1_write", keys=keys, seed=1)[0] == [True, True]
    assert served.stat()["server"]["sessions"] == 1


def test_get_outcomes_are_told_apart_by_type_not_text(served):
    """Issue 28: a server-mode get's item outcomes cross the socket typed and kvtier-py maps
    them once: a miss is a bare False (no message), a wrong length is False with the
    server's reason, a hit is True with the bytes; a server gone fails every item."""
    store = kvtier.Store(json.dumps({"server_socket": served.socket}))
    value = np.arange(4096, dtype=np.uint8) % 251
    assert store.put_buffers(["present"], [value]) == ([True], [])
    whole = np.zeros(4096, dtype=np.uint8)
    short = np.zeros(100, dtype=np.uint8)
    missing = np.zeros(4096, dtype=np.uint8)
    ok, errors = store.get_buffers(["absent", "present", "present"], [missing, short, whole])
    assert ok == [False, False, True], errors
    assert (whole == value).all()
    # Only the wrong length says something; the miss is an answer, not an error.
    assert len(errors) == 1 and "present" in errors[0] and "absent" not in errors[0], errors
    served.stop()
    ok, errors = store.get_buffers(["present"], [whole])
    assert ok == [False] and len(errors) == 1, errors
    store.close()


def test_stat_cli_and_sigterm_graceful_shutdown(served, ranks):
    (r0,) = ranks(1)
    r0("setup", kind="mha", tp_rank=0, tp_size=1, socket=served.socket)
    r0("v1_write", keys=keys_for(3, "t"), seed=1)
    text = subprocess.run(
        [str(served.binary), "stat", "--socket", served.socket],
        check=True,
        capture_output=True,
        text=True,
        timeout=30,
    ).stdout
    assert "sessions 1" in text and "store main" in text, text
    served.proc.send_signal(signal.SIGTERM)
    assert served.proc.wait(timeout=30) == 0, served.output()
    assert not os.path.exists(served.socket), "socket removed on shutdown"
    out = served.output()
    assert "shutting down" in out and "stopped" in out, out
    # The client fails cleanly afterwards: a miss, not a crash.
    got, _ = r0("v1_read", keys=keys_for(3, "t"))
    assert got == [False] * 3


def test_socket_is_private_by_default(served):
    assert (os.stat(served.socket).st_mode & 0o777) == 0o600


def test_restarted_server_serves_ssd_contents_and_clients_reconnect(kvtier_bin, tmp_path, ranks):
    ssd = tmp_path / "ssd"
    args = [
        "--engine",
        "ssd_enabled=true",
        "--engine",
        f"ssd_storage_dir={ssd}",
        "--engine",
        "ssd_capacity_bytes=256MiB",
        "--engine",
        "ssd_segment_size_bytes=16MiB",
    ]
    first = Served(kvtier_bin, tmp_path, *args)
    (r0,) = ranks(1)
    try:
        r0("setup", kind="mha", tp_rank=0, tp_size=1, socket=first.socket)
        keys = keys_for(6, "warm")
        ok, written = r0("v1_write", keys=keys, seed=9)
        assert ok == [True] * 6
    finally:
        first.stop()  # SIGTERM: flush, sync, exit
    assert first.proc.returncode == 0, first.output()
    second = Served(kvtier_bin, tmp_path, *args)
    try:
        # The rank's session died with the first server; its next call opens a new one and
        # registers its memfds again, then reads what the first server stored on SSD.
        got, data = r0("v1_read", keys=keys)
        assert got == [True] * 6 and data == written
        assert r0("stats")["zero_copy_regions"] >= 1, "memfds registered again"

        assert main_store(second.stat())["ssd_hits"] >= 6
    finally:
        second.stop()


def test_server_auto_start_spawns_kvtier_serve_when_none_listens(kvtier_bin, tmp_path, monkeypatch):
    from kvtier import _native

    sock = str(tmp_path / "auto.sock")
    monkeypatch.setenv("KVTIER_SERVER_BIN", str(kvtier_bin))
    monkeypatch.setenv("KVTIER_DRAM_CAPACITY_BYTES", "64MiB")
    monkeypatch.setenv("KVTIER_DRAM_PREFAULT", "false")
    store = _native.Store(json.dumps({"server_socket": sock, "server_auto_start": True}))
    pid = None
    try:
        assert store.mode == "server"
        assert store.put_buffers(["auto"], [bytearray(b"started")]) == ([True], [])
        out = subprocess.run(
            [str(kvtier_bin), "stat", "--socket", sock, "--json"],
            check=True,
            capture_output=True,
            text=True,
            timeout=30,
        )
        pid = json.loads(out.stdout)["server"]["pid"]
        assert pid != os.getpid()
    finally:
        store.close()
        if pid is not None:
            os.kill(pid, signal.SIGTERM)
            deadline = time.time() + 30
            while _connectable(sock) and time.time() < deadline:
                time.sleep(0.05)
    assert not _connectable(sock)
