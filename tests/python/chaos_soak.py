"""The project's chaos soak (issue 29 §4): real processes, seeded faults, a bounded run.

One command (as root: it makes network namespaces)::

    .venv/bin/python tests/python/chaos_soak.py --seed 7 --duration 150

What runs: a real etcd on 127.0.0.1, two ``kvtier master --etcd`` (election), three
``kvtier serve --master`` nodes with a strict write-through SSD tier, each in its own network
namespace on a bridge this script creates. The masters have an address of their own on the
bridge and the host-side clients another, so a node's control plane and data plane can be cut
apart: a cut is a blackhole route inside the node's namespace (this kernel has no tc actions
and no netfilter). The clients, on the host side: raw clients (``kvtier.Store`` of the real
Python module, separate processes), one of them over UCX (nodes offer ``cluster_transport =
ucx``; UCX's TCP lanes with the INSECURE test hook, as there is no RDMA), a client that is
SIGKILLed in the middle of its batches and started again, and one SGLang host process
(test_cluster's ``Host``: real SGLang host pools, the ``KvtierStore`` backend,
``batch_set_v1`` / ``batch_get_v1`` / ``batch_exists``). Every client writes in namespace
``soak`` with replication 2, within a budget that keeps everything far below the SSD tiers.

Faults (a seeded shuffle of every kind, one at a time, each healed before the next): node
SIGKILL + restart, leader master SIGKILL + restart, a node SIGSTOPped beyond its lease, etcd
SIGKILL + restart, a node's graceful stop + restart, a node's control-plane link cut, its data
plane cut (frames and UCX), its whole link down, a full disk (node-2's SSD directory is a
tmpfs; a ballast file fills it), a slow disk (a blkio cgroup throttles a node's writes), once
a node's disk wiped (only when every acknowledged object had two live copies), and
continuously the killed client.

Oracle: every read returns the object's bytes (they derive from the key, so any read can be
checked) or a clean miss; every acknowledged object reads back exact at the end (after the
nodes are back); no process we did not kill exits, no ``panicked`` in any log, never two
masters answering as leader (sampled every 0.25 s); every fault recovers within
``RECOVERY_LIMIT_S``. The report gives operations, errors by kind, faults by kind, recovery
times (leader back, node registered again, first successful put+get, replicas restored) and
every violation; exit status 1 on any violation. docs/soak.md has the results.

Helpers are test_cluster's (``Master``, ``Node``, ``Netns``, ``Host``); every process is
started here and stopped by its pid; the namespaces and the bridge are removed at the end,
also on failure.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import types
import urllib.request
import zlib
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
TOOLS = ROOT / "tools" / "python"
for p in (str(HERE), str(TOOLS)):
    if p not in sys.path:
        sys.path.insert(0, p)
os.environ["PYTHONPATH"] = os.pathsep.join(
    p for p in (str(TOOLS), str(HERE), os.environ.get("PYTHONPATH", "")) if p
)
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

TOKEN = "chaos-soak-token"
NAMESPACE = "soak"
LEASE_MS = 1500
ELECTION_TTL_S = 2
REQUEST_TIMEOUT_MS = 500
MASTER_RETRY_MS = 2000
ETCD = "/usr/bin/etcd"
# What a client writes at most (bytes of new objects): the acknowledged objects of a run
# stay far below the nodes' SSD capacity (3 x 512 MiB, two copies each), so nothing is
# evicted and every acknowledged object must survive.
RAW_BUDGET = 24 << 20
KILLED_BUDGET = 1 << 20
KILLED_WRITERS = 64  # killed clients after these read only (a long run's data stays bounded)
# The SGLang host writes at most this many pages (32 KiB each: 2 x 16 KiB objects), then
# only reads. With the budgets above, every node's share of two copies of everything stays
# under half of its SSD tier, including each record's 4 KiB alignment.
SGLANG_PAGES = 2400
SSD_CAPACITY = "512MiB"
UCX_HOOK = "TEST_INSECURE_UCX_EMULATED_RMA"
# The node whose SSD directory is a small tmpfs (the full-disk fault fills it), and its size.
FULL_DISK_NODE = "node-2"
# Above the SSD capacity, so the tier never meets the end of the filesystem unless the fault
# fills it (tmpfs takes memory only for what is written).
FULL_DISK_SIZE = 640 << 20
# The slow disk: the node's writes to the SSD's block device throttled (cgroup v1 blkio).
SLOW_DISK_BPS = 256 << 10
SLOW_DISK_IOPS = 16
BLKIO = Path("/sys/fs/cgroup/blkio")
# How long one fault's recovery may take before it is reported as not recovered.
RECOVERY_LIMIT_S = 30.0
# How long a SIGKILLed node stays down at most while the soak times re-replication.
REREPLICATION_LIMIT_S = 15.0


def log(msg):
    print(f"[soak {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def value_of(key: str):
    """The bytes of raw-client object ``key``: its length (1-16 KiB) and content derive from
    the key, so any read of any key can be checked."""
    import numpy as np

    h = zlib.crc32(key.encode())
    n = 1024 * (1 + h % 16)
    return np.random.default_rng(h).integers(0, 256, n, dtype=np.uint8)


def store_config(masters, **extra):
    cfg = dict(
        master_address=masters,
        extra_backend_tag=NAMESPACE,
        cluster_request_timeout_ms=REQUEST_TIMEOUT_MS,
        cluster_master_retry_ms=MASTER_RETRY_MS,
    )
    cfg.update(extra)
    return cfg


# ------------------------------------------------------------------------------ raw client


def client_main(args):
    """A raw client process: puts of fresh keys, reads of its acknowledged ones, exists; one
    line per event in ``args.log`` (I: intent, A: acknowledged, W: wrong bytes, E: error class)
    until SIGTERM or its deadline."""
    import numpy as np

    import kvtier

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    rng = random.Random(args.seed)
    out = open(args.log, "a", buffering=1)
    extra = json.loads(args.extra or "{}")
    store = None
    deadline = time.time() + args.seconds
    acked: list[str] = []
    seq = 0
    written = 0
    counts = dict(puts=0, put_ok=0, put_fail=0, gets=0, get_hit=0, get_miss=0, wrong=0, exists=0)
    errors: dict[str, int] = {}

    examples: dict[str, str] = {}

    def classify(msg):
        c = _classify(msg)
        examples.setdefault(c, msg[:300])
        return c

    def _classify(msg):
        for word in (
            "no leader",
            "no room",
            "marked down",
            "node unavailable",
            "timed out",
            "timeout",
            "unavailable",
            "malformed",
            "busy",
        ):
            if word in msg:
                return word
        return msg[:60]

    while not stop.is_set() and time.time() < deadline:
        if store is None:
            try:
                store = kvtier.Store(json.dumps(store_config(args.masters, **extra)))
            except Exception as e:  # no leader yet: try again
                errors[f"open: {classify(str(e))}"] = errors.get(f"open: {classify(str(e))}", 0) + 1
                time.sleep(0.2)
                continue
        op = rng.random()
        if not acked and written >= args.max_bytes:
            time.sleep(0.1)  # nothing to read yet and nothing left to write
            continue
        if (op < 0.5 or not acked) and written < args.max_bytes:
            n = rng.randint(args.batch_min, args.batch_max)
            keys = [f"{args.name}-{seq + i}" for i in range(n)]
            seq += n
            out.write("I " + " ".join(keys) + "\n")
            vals = [value_of(k) for k in keys]
            written += sum(len(v) for v in vals)
            try:
                ok, errs = store.put_buffers(keys, vals)
            except Exception as e:
                ok, errs = [False] * n, [str(e)]
            counts["puts"] += n
            good = [k for k, o in zip(keys, ok) if o]
            counts["put_ok"] += len(good)
            counts["put_fail"] += n - len(good)
            for e in errs:
                c = classify(str(e))
                errors[c] = errors.get(c, 0) + 1
                if c == "no room":  # when: the report relates these to leader changes
                    out.write(f"E {time.time():.3f} no-room\n")
            if good:
                out.write("A " + " ".join(good) + "\n")
                acked.extend(good)
        elif op < 0.9 and acked:
            keys = rng.sample(acked, min(len(acked), rng.randint(1, 8)))
            dsts = [np.zeros(len(value_of(k)), dtype=np.uint8) for k in keys]
            try:
                ok, errs = store.get_buffers(keys, dsts)
            except Exception as e:
                ok, errs = [False] * len(keys), [str(e)]
            counts["gets"] += len(keys)
            for k, o, d in zip(keys, ok, dsts):
                if not o:
                    counts["get_miss"] += 1
                elif np.array_equal(d, value_of(k)):
                    counts["get_hit"] += 1
                else:
                    counts["wrong"] += 1
                    out.write(f"W {k}\n")
            for e in errs:
                c = classify(str(e))
                errors[c] = errors.get(c, 0) + 1
        elif acked:
            keys = rng.sample(acked, min(len(acked), 16))
            try:
                store.exists_keys(keys)
            except Exception as e:
                c = classify(str(e))
                errors[c] = errors.get(c, 0) + 1
            counts["exists"] += len(keys)
        if args.pause:
            time.sleep(args.pause)
    transports = []
    if store is not None:
        stats = json.loads(store.stats_json())
        transports = [(p["peer"], p["transport"]) for p in stats.get("peer_transports", [])]
    out.write(
        "S "
        + json.dumps(
            dict(
                name=args.name,
                counts=counts,
                errors=errors,
                examples=examples,
                transports=transports,
            )
        )
        + "\n"
    )
    out.close()
    if store is not None:
        store.close()


# ------------------------------------------------------------------------------ processes


def _test_cluster():
    import test_cluster

    return test_cluster


class Etcd:
    """A real etcd on free loopback ports, data in ``directory``; ``restart`` keeps both."""

    def __init__(self, directory: Path):
        tc = _test_cluster()
        self.dir = directory
        self.client_port = tc.free_port()
        peer = tc.free_port()
        while peer == self.client_port:
            peer = tc.free_port()
        self.endpoint = f"http://127.0.0.1:{self.client_port}"
        peer_url = f"http://127.0.0.1:{peer}"
        self.args = [
            ETCD,
            "--name",
            "soak",
            "--data-dir",
            str(directory / "etcd"),
            "--listen-client-urls",
            self.endpoint,
            "--advertise-client-urls",
            self.endpoint,
            "--listen-peer-urls",
            peer_url,
            "--initial-advertise-peer-urls",
            peer_url,
            "--initial-cluster",
            f"soak={peer_url}",
            "--initial-cluster-state",
            "new",
            "--log-level",
            "error",
        ]
        self.proc = None
        self.start()

    def start(self):
        logf = open(self.dir / "etcd.log", "a")
        self.proc = subprocess.Popen(self.args, stdout=logf, stderr=subprocess.STDOUT)
        logf.close()
        deadline = time.time() + 20
        while not _test_cluster()._tcp_open(f"127.0.0.1:{self.client_port}"):
            assert self.proc.poll() is None, "etcd exited at start"
            assert time.time() < deadline, "etcd did not start"
            time.sleep(0.02)

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def make_master_class():
    tc = _test_cluster()

    class EtcdMaster(tc.Master):
        """test_cluster's Master with etcd election and the soak's replication, on a fixed
        address (a restart comes back where the nodes and clients look for it)."""

        def __init__(self, binary, directory, address, etcd, metrics):
            self.address, self.metrics = address, metrics
            self.binary = binary
            self.log = open(directory / f"master-{address.replace(':', '_')}.log", "a+")
            self.proc = subprocess.Popen(
                [
                    str(binary),
                    "master",
                    "--listen",
                    address,
                    "--lease-ms",
                    str(LEASE_MS),
                    "--etcd",
                    etcd,
                    "--election-ttl-s",
                    str(ELECTION_TTL_S),
                    "--replication",
                    f"{NAMESPACE}=2",
                    "--metrics-addr",
                    metrics,
                ],
                stdout=self.log,
                stderr=subprocess.STDOUT,
            )
            deadline = time.time() + 20
            while not tc._tcp_open(self.address):
                assert self.proc.poll() is None, self.output()
                assert time.time() < deadline, "kvtier master did not start"
                time.sleep(0.02)

        def leads(self):
            """True: answers as leader (``kvtier_master_is_leader 1`` on its loopback metrics
            endpoint; ``kvtier stat`` would look for a leader for 5 s at a follower)."""
            try:
                with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except OSError:
                return False
            return any(
                line.split()[-1] == "1"
                for line in text.splitlines()
                if line.startswith("kvtier_master_is_leader")
            )

    return EtcdMaster


def make_bridged_netns_class():
    tc = _test_cluster()

    class BridgedNetns(tc.Netns):
        """test_cluster's Netns, its host end on the soak's bridge instead of addressed, so
        the namespaces reach each other (node to node copies) and the masters on the bridge's
        addresses without forwarding. ``cut`` blackholes addresses inside the namespace: the
        masters' (control plane) or the clients' and other nodes' (data plane)."""

        def __init__(self, name, host_if, ns_if, ns_ip, bridge):
            self.name, self.host_if, self.ns_if = name, host_if, ns_if
            self.ns_ip, self.bridge = ns_ip, bridge
            self.created = False
            self.cut_to = []

        def create(self):
            self.run("ip", "netns", "add", self.name)
            self.created = True
            self.run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            self.run("ip", "link", "set", self.ns_if, "netns", self.name)
            self.run("ip", "link", "set", self.host_if, "master", self.bridge)
            self.run("ip", "link", "set", self.host_if, "up")
            self.run("ip", "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if, ns=True)
            self.run("ip", "link", "set", self.ns_if, "up", ns=True)
            self.run("ip", "link", "set", "lo", "up", ns=True)

        def wrapper(self, binary, directory: Path, env: dict):
            path = directory / f"kvtier-in-{self.name}"
            sets = " ".join(f"{k}={v}" for k, v in env.items())
            path.write_text(f'#!/bin/sh\nexec ip netns exec {self.name} env {sets} {binary} "$@"\n')
            path.chmod(0o755)
            return path

        def cut(self, addresses):
            """Blackhole routes in the namespace to ``addresses``: packets to them vanish
            (a partition, not a refusal), the replies to whatever they send too."""
            for a in addresses:
                self.run("ip", "route", "add", "blackhole", f"{a}/32", ns=True)
            self.cut_to = list(addresses)

        def heal(self):
            for a in self.cut_to:
                subprocess.run(
                    ["ip", "-n", self.name, "route", "del", "blackhole", f"{a}/32"],
                    capture_output=True,
                    timeout=10,
                )
            self.cut_to = []

        def remove(self):
            if not self.created:
                return
            for pid in subprocess.run(
                ["ip", "netns", "pids", self.name], capture_output=True, text=True, timeout=10
            ).stdout.split():
                # Only processes this soak started live there (the nodes); killed by pid.
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=10)
            subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=10)
            self.created = False

    return BridgedNetns


# ------------------------------------------------------------------------------ the soak


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.binary = Path(args.binary)
        self.tmp = Path(tempfile.mkdtemp(prefix=f"kvtier-soak-{args.seed}-"))
        self.tc = _test_cluster()
        self.faults: list[dict] = []
        self.violations: list[str] = []
        self.notes: list[str] = []
        self.leader_samples = 0
        self.no_leader_samples = 0
        self.netns: dict[str, object] = {}
        self.nodes: dict[str, object] = {}
        self.node_gen: dict[str, int] = {}
        self.data_addr: dict[str, str] = {}
        self.masters = []
        self.etcd = None
        self.bridge = None
        self.clients: list[subprocess.Popen] = []
        self.client_logs: list[Path] = []
        self.host = None
        self.sglang = dict(puts=0, put_ok=0, gets=0, get_hit=0, get_miss=0, wrong=0, errors=0)
        self.sglang_truth: dict[str, str] = {}
        self.sglang_lock = threading.Lock()
        self.stop_flag = threading.Event()
        self.expected_dead: set[int] = set()
        self.client_kills = 0
        self.leader_changes: list[float] = []

    # -------------------------------------------------------------- setup

    def setup(self):
        os.environ["KVTIER_CLUSTER_TOKEN"] = TOKEN
        tag = f"{os.getpid() % 10000:04d}"
        # A /24 no interface here uses yet (another soak may run at the same time).
        taken = subprocess.run(["ip", "-o", "addr"], capture_output=True, text=True).stdout
        free = [n for n in range(1, 250) if f" 10.79.{n}." not in taken]
        subnet = f"10.79.{self.rng.choice(free)}"
        self.bridge = f"kvsb{tag}"
        subprocess.run(["ip", "link", "add", self.bridge, "type", "bridge"], check=True, timeout=10)
        subprocess.run(
            ["ip", "addr", "add", f"{subnet}.1/24", "dev", self.bridge], check=True, timeout=10
        )
        subprocess.run(["ip", "link", "set", self.bridge, "up"], check=True, timeout=10)
        self.hub_ip = f"{subnet}.1"  # the host side's clients (the bridge's primary address)
        self.master_ip = f"{subnet}.254"  # the masters: a control-plane cut blackholes it
        subprocess.run(
            ["ip", "addr", "add", f"{self.master_ip}/24", "dev", self.bridge],
            check=True,
            timeout=10,
        )
        self.node_ips = [f"{subnet}.{2 + i}" for i in range(3)]
        # Clients on the host reach the nodes over the bridge: UCX (if a client uses it) too.
        os.environ["UCX_TLS"] = "tcp"
        os.environ["UCX_NET_DEVICES"] = self.bridge
        Bridged = make_bridged_netns_class()
        for i in range(3):
            node_id = f"node-{i}"
            ns = Bridged(
                f"kvtier-soak{tag}-{i}",
                f"kvsh{tag}{i}",
                f"kvsn{tag}{i}",
                f"{subnet}.{2 + i}",
                self.bridge,
            )
            self.netns[node_id] = ns
            ns.create()
            self.data_addr[node_id] = f"{ns.ns_ip}:{7900 + i}"
        self.etcd = Etcd(self.tmp)
        EtcdMaster = make_master_class()
        addrs = [f"{self.master_ip}:{self.tc.free_port(self.master_ip)}" for _ in range(2)]
        while addrs[1] == addrs[0]:
            addrs[1] = f"{self.master_ip}:{self.tc.free_port(self.master_ip)}"
        self.master_addrs = addrs
        self.master_metrics = [f"127.0.0.1:{self.tc.free_port()}" for _ in addrs]
        while self.master_metrics[1] == self.master_metrics[0]:
            self.master_metrics[1] = f"127.0.0.1:{self.tc.free_port()}"
        self.masters = [
            EtcdMaster(self.binary, self.tmp, a, self.etcd.endpoint, m)
            for a, m in zip(addrs, self.master_metrics)
        ]
        self.joined = ",".join(addrs)
        self.view = types.SimpleNamespace(binary=self.binary, address=self.joined)
        self.wait(15, "a leader", lambda: self.leader() is not None)
        full = self.tmp / f"{FULL_DISK_NODE}-ssd"
        full.mkdir()
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={FULL_DISK_SIZE},mode=0700", "tmpfs", str(full)],
            check=True,
            timeout=10,
        )
        self.mounted = full
        self.setup_slow_disk()
        for node_id in self.netns:
            self.start_node(node_id)
        self.wait(20, "three nodes", lambda: len(self.alive_nodes()) == 3)
        log(f"cluster up: etcd {self.etcd.endpoint}, masters {self.joined}, nodes {self.data_addr}")

    def start_node(self, node_id):
        ns = self.netns[node_id]
        gen = self.node_gen.get(node_id, 0) + 1
        self.node_gen[node_id] = gen
        base = self.tmp / f"{node_id}-gen{gen}"
        base.mkdir()
        ssd = self.tmp / f"{node_id}-ssd"
        env = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": ns.ns_if}
        transport = []
        if self.args.ucx:
            # The INSECURE test hook (docs/security.md): UCX over TCP emulates one-sided
            # access, which kvtier refuses by default; there is no RDMA here.
            env[UCX_HOOK] = "1"
            transport = ["--engine", "cluster_transport=ucx"]
        wrapper = ns.wrapper(self.binary, base, env)
        self.nodes[node_id] = self.tc.Node(
            wrapper,
            base,
            self.joined,
            node_id,
            self.data_addr[node_id],
            "--engine",
            "ssd_enabled=true",
            "--engine",
            f"ssd_storage_dir={ssd}",
            "--engine",
            f"ssd_capacity_bytes={SSD_CAPACITY}",
            "--engine",
            "ssd_segment_size_bytes=4MiB",
            "--engine",
            "ssd_durability_mode=strict",
            "--engine",
            "ssd_write_policy=write_through",
            *transport,
            dram="128MiB",
        )

    def setup_slow_disk(self):
        """A blkio cgroup (v1) throttling writes to the block device under the work
        directory; None where the kernel offers none (the slow-disk fault is then skipped)."""
        self.slow_cg = None
        dev = os.stat(self.tmp).st_dev
        major, minor = os.major(dev), os.minor(dev)
        # A partition's writes are throttled at its disk: look the disk up in sysfs.
        sys_dev = Path(f"/sys/dev/block/{major}:{minor}")
        if (sys_dev / "partition").exists():
            major, minor = (
                int(x) for x in (sys_dev.resolve().parent / "dev").read_text().split(":")
            )
        if not (BLKIO / "blkio.throttle.write_bps_device").exists():
            self.notes.append("slow disk: no blkio cgroup here; fault skipped")
            return
        cg = BLKIO / f"kvtier-soak-{os.getpid()}"
        cg.mkdir(exist_ok=True)
        (cg / "blkio.throttle.write_bps_device").write_text(f"{major}:{minor} {SLOW_DISK_BPS}")
        (cg / "blkio.throttle.write_iops_device").write_text(f"{major}:{minor} {SLOW_DISK_IOPS}")
        self.slow_cg = cg

    def wait(self, limit, what, cond, interval=0.1):
        """Seconds until ``cond()``; None (and a violation) after ``limit``."""
        started = time.perf_counter()
        while True:
            try:
                if cond():
                    return time.perf_counter() - started
            except Exception:
                pass
            if time.perf_counter() - started > limit:
                self.violations.append(f"not recovered within {limit:.0f} s: {what}")
                log(f"VIOLATION: not recovered within {limit:.0f} s: {what}")
                return None
            time.sleep(interval)

    def leader(self):
        leading = [m for m in self.masters if m.proc.poll() is None and m.leads()]
        return leading[0] if len(leading) == 1 else None

    def alive_nodes(self):
        out = subprocess.run(
            [str(self.binary), "stat", "--master", self.joined, "--json"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        if out.returncode != 0:
            return []
        return sorted(n["node_id"] for n in json.loads(out.stdout)["nodes"] if n["alive"])

    # -------------------------------------------------------------- monitors

    def leader_monitor(self):
        last = None
        while not self.stop_flag.is_set():
            leading = [m.address for m in self.masters if m.proc.poll() is None and m.leads()]
            if leading != last:
                self.leader_changes.append(time.time())
                last = leading
            self.leader_samples += 1
            if not leading:
                self.no_leader_samples += 1
            if len(leading) > 1:
                self.violations.append(f"two leaders at {time.strftime('%H:%M:%S')}: {leading}")
            time.sleep(0.25)

    def probe(self):
        """A fresh key put and read back through a raw store of the real module."""
        import kvtier
        import numpy as np

        key = f"probe-{time.monotonic_ns()}"
        want = value_of(key)
        store = kvtier.Store(json.dumps(store_config(self.joined)))
        try:
            ok, _ = store.put_buffers([key], [want])
            if ok != [True]:
                return False
            dst = np.zeros(len(want), dtype=np.uint8)
            ok, _ = store.get_buffers([key], [dst])
            if ok == [True] and not np.array_equal(dst, want):
                self.violations.append(f"probe {key}: wrong bytes")
            return ok == [True]
        finally:
            store.close()

    # -------------------------------------------------------------- clients

    def spawn_client(
        self, name, seconds, max_bytes, batch=(1, 8), pause=0.05, extra=None, env=None
    ):
        path = self.tmp / f"client-{name}.log"
        self.client_logs.append(path)
        seed = self.rng.randrange(1 << 30)
        cmd = [
            sys.executable, __file__, "client", "--name", name, "--masters", self.joined,
            "--log", str(path), "--seed", str(seed), "--seconds", str(seconds),
            "--batch-min", str(batch[0]), "--batch-max", str(batch[1]), "--pause", str(pause),
            "--extra", json.dumps(extra or {}), "--max-bytes", str(max_bytes),
        ]  # fmt: skip
        proc = subprocess.Popen(
            cmd,
            env={**os.environ, **(env or {})},
            stdout=subprocess.DEVNULL,
            stderr=open(self.tmp / f"client-{name}.err", "w"),
        )
        self.clients.append(proc)
        return proc

    def killer_loop(self, seconds):
        """Start a client that writes 48-key batches of up to 64 KiB objects, SIGKILL it at a
        random point of its work, start the next one."""
        n = 0
        while not self.stop_flag.is_set():
            budget = KILLED_BUDGET if n < KILLED_WRITERS else 0
            proc = self.spawn_client(f"killed{n}", seconds, budget, batch=(32, 32), pause=0.02)
            n += 1
            t = self.rng.uniform(2.0, 5.0)
            if self.stop_flag.wait(t):
                return
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
                self.expected_dead.add(proc.pid)
                self.client_kills += 1

    def sglang_loop(self):
        host = self.host
        rng = random.Random(self.rng.randrange(1 << 30))
        n = 0
        while not self.stop_flag.is_set():
            writes_left = self.sglang["puts"] < SGLANG_PAGES
            if (rng.random() < 0.5 or not self.sglang_truth) and writes_left:
                keys = [f"sg-{n}-{i}" for i in range(4)]
                n += 1
                try:
                    ok, digests, _ = host(
                        "v1_write_hashed", keys=keys, seed=rng.randrange(1 << 16), timeout=60
                    )
                except Exception as e:
                    self.sglang["errors"] += 1
                    self.notes.append(f"sglang write raised: {str(e)[-200:]}")
                    continue
                with self.sglang_lock:
                    self.sglang["puts"] += len(keys)
                    for k, o, d in zip(keys, ok, digests):
                        if o:
                            self.sglang["put_ok"] += 1
                            self.sglang_truth[k] = d
            elif self.sglang_truth:
                with self.sglang_lock:
                    keys = rng.sample(sorted(self.sglang_truth), min(4, len(self.sglang_truth)))
                try:
                    ok, digests, _ = host("v1_read_hashed", keys=keys, timeout=60)
                except Exception as e:
                    self.sglang["errors"] += 1
                    self.notes.append(f"sglang read raised: {str(e)[-200:]}")
                    continue
                self.sglang["gets"] += len(keys)
                for k, o, d in zip(keys, ok, digests):
                    if not o:
                        self.sglang["get_miss"] += 1
                    elif d == self.sglang_truth[k]:
                        self.sglang["get_hit"] += 1
                    else:
                        self.sglang["wrong"] += 1
                        self.violations.append(f"SGLang read of {k}: wrong bytes")
            time.sleep(0.05)

    def start_sglang(self):
        tc = self.tc
        self.host = tc.Host()
        started = time.perf_counter()
        self.host("warm", timeout=300)
        self.host(
            "setup",
            kind="mha",
            tp_rank=0,
            tp_size=1,
            socket=None,
            timeout=120,
            **store_config(self.joined),
        )
        log(
            f"SGLang host process {self.host.proc.pid} ready in {time.perf_counter() - started:.1f} s"
        )

    # -------------------------------------------------------------- acknowledged objects

    def read_logs(self):
        acked, intended, wrong, summaries = set(), set(), [], []
        self.no_room_at: list[float] = []
        for path in self.client_logs:
            if not path.exists():
                continue
            for line in path.read_text().splitlines():
                kind, _, rest = line.partition(" ")
                if kind == "A":
                    acked.update(rest.split())
                elif kind == "I":
                    intended.update(rest.split())
                elif kind == "W":
                    wrong.append(rest)
                elif kind == "S":
                    summaries.append(json.loads(rest))
                elif kind == "E":
                    self.no_room_at.append(float(rest.split()[0]))
        return acked, intended, wrong, summaries

    def holders(self, keys):
        mark = self.tc.CLUSTER_MARK
        full = [f"{mark}{NAMESPACE}\x1f{k}" for k in keys]
        held = {}
        for i in range(0, len(full), 2000):
            got = self.tc.Master.holders(self.view, full[i : i + 2000])
            held.update({k.split("\x1f", 1)[1]: v for k, v in got.items()})
        return held

    def under_replicated(self, keys):
        alive = set(self.alive_nodes())
        held = self.holders(keys)
        return [k for k in keys if len(set(held.get(k, [])) & alive) < 2]

    # -------------------------------------------------------------- faults

    def since(self, t0, what, cond, interval=0.1):
        """Seconds from ``t0`` (the heal or restart) until ``cond()``; None after the limit."""
        took = self.wait(RECOVERY_LIMIT_S, what, cond, interval)
        return None if took is None else time.perf_counter() - t0

    def node_recovered(self, node_id, fault, t0):
        """From ``t0`` (the heal, or the restart's start): the node listed alive again, then a
        put and its read-back through a fresh client."""
        fault["node_back_s"] = self.since(
            t0, f"{node_id} registered again", lambda: node_id in self.alive_nodes()
        )
        fault["rw_back_s"] = self.since(t0, "a put and its read-back", self.probe, 0.05)

    def restart_node(self, node_id):
        self.nodes[node_id].log.close()
        self.start_node(node_id)

    def f_node_kill(self, fault):
        node_id = fault["node"] = self.rng.choice(sorted(self.nodes))
        before, _, _, _ = self.read_logs()
        self.nodes[node_id].sigkill()
        self.expected_dead.add(self.nodes[node_id].proc.pid)
        t0 = time.perf_counter()
        fault["replicas_after_death_s"] = self.measure_replicas(sorted(before), t0, node_id)
        time.sleep(self.rng.uniform(0.5, 2.0))
        t0 = time.perf_counter()
        self.restart_node(node_id)
        self.node_recovered(node_id, fault, t0)

    def measure_replicas(self, keys, t0, dead):
        """Seconds from ``t0`` until every key of ``keys`` has two live holders other than
        ``dead`` (re-replication after a node death), bounded."""
        keys = keys[-3000:]
        if not keys:
            return None
        first = True
        while time.perf_counter() - t0 < REREPLICATION_LIMIT_S:
            try:
                held = self.holders(keys)
            except Exception:
                time.sleep(0.2)
                continue
            alive = set(self.alive_nodes()) - {dead}
            short = [k for k in keys if len(set(held.get(k, [])) & alive) < 2]
            if first:
                first = False
                log(
                    f"  {len(short)} of {len(keys)} objects below two live copies, e.g. "
                    f"{[(k, held.get(k)) for k in short[:3]]}, alive {sorted(alive)}"
                )
            if not short:
                return time.perf_counter() - t0
            time.sleep(0.2)
        self.notes.append(
            f"re-replication after {dead} died: {len(short)} of {len(keys)} objects still had one live copy after {REREPLICATION_LIMIT_S:.0f} s"
        )
        return None

    def f_graceful_stop(self, fault):
        node_id = fault["node"] = self.rng.choice(sorted(self.nodes))
        t = time.perf_counter()
        self.nodes[node_id].stop()
        fault["stop_s"] = time.perf_counter() - t
        self.expected_dead.add(self.nodes[node_id].proc.pid)
        time.sleep(self.rng.uniform(0.5, 1.5))
        t0 = time.perf_counter()
        self.start_node(node_id)
        self.node_recovered(node_id, fault, t0)

    def f_sigstop(self, fault):
        node_id = fault["node"] = self.rng.choice(sorted(self.nodes))
        pid = self.nodes[node_id].proc.pid
        os.kill(pid, signal.SIGSTOP)
        held = LEASE_MS / 1e3 * self.rng.uniform(1.5, 3.0)
        fault["held_s"] = held
        time.sleep(held)
        os.kill(pid, signal.SIGCONT)
        self.node_recovered(node_id, fault, time.perf_counter())

    def f_leader_kill(self, fault):
        leader = self.leader()
        if leader is None:
            fault["skipped"] = "no single leader"
            return
        fault["master"] = leader.address
        leader.proc.kill()
        leader.proc.wait(10)
        self.expected_dead.add(leader.proc.pid)
        t0 = time.perf_counter()
        fault["leader_back_s"] = self.since(
            t0, "a new leader", lambda: self.leader() is not None, 0.05
        )
        fault["rw_back_s"] = self.since(t0, "a put and its read-back", self.probe, 0.05)
        i = self.masters.index(leader)
        leader.log.close()
        self.masters[i] = make_master_class()(
            self.binary, self.tmp, leader.address, self.etcd.endpoint, leader.metrics
        )

    def f_etcd_restart(self, fault):
        self.etcd.kill()
        self.expected_dead.add(self.etcd.proc.pid)
        killed = time.perf_counter()
        time.sleep(0.5)
        self.etcd.start()
        fault["down_s"] = time.perf_counter() - killed
        t0 = time.perf_counter()
        fault["leader_back_s"] = self.since(
            t0, "a leader after etcd's return", lambda: self.leader() is not None, 0.05
        )
        fault["rw_back_s"] = self.since(t0, "a put and its read-back", self.probe, 0.05)

    def f_link(self, fault, kind):
        node_id = fault["node"] = self.rng.choice(sorted(self.nodes))
        ns = self.netns[node_id]
        held = LEASE_MS / 1e3 * self.rng.uniform(1.2, 2.5)
        fault["held_s"] = held
        if kind == "link_down":
            ns.link(False)
        elif kind == "control_cut":
            ns.cut([self.master_ip])
        else:
            ns.cut([self.hub_ip] + [ip for ip in self.node_ips if ip != ns.ns_ip])
        try:
            time.sleep(held)
        finally:
            if kind == "link_down":
                ns.link(True)
            else:
                ns.heal()
        self.node_recovered(node_id, fault, time.perf_counter())

    def f_disk_wipe(self, fault):
        acked, _, _, _ = self.read_logs()
        keys = sorted(acked)
        t = self.wait(
            RECOVERY_LIMIT_S,
            "every acknowledged object with two live copies before the wipe",
            lambda: not self.under_replicated(keys),
            0.3,
        )
        if t is None:
            self.violations.pop()  # reported as a skipped wipe, not a loss
            fault["skipped"] = "objects with one live copy remained"
            return
        node_id = fault["node"] = self.rng.choice(sorted(self.nodes))
        self.nodes[node_id].sigkill()
        self.expected_dead.add(self.nodes[node_id].proc.pid)
        shutil.rmtree(self.tmp / f"{node_id}-ssd", ignore_errors=True)
        fault["objects_checked"] = len(keys)
        t0 = time.perf_counter()
        self.restart_node(node_id)
        self.node_recovered(node_id, fault, t0)
        fault["replicas_restored_s"] = self.since(
            t0, "two live copies again after the wipe", lambda: not self.under_replicated(keys), 0.3
        )

    def f_full_disk(self, fault):
        """Fill the tmpfs under ``FULL_DISK_NODE``'s SSD tier (a ballast file), let the
        clients write a while, remove the ballast."""
        node_id = fault["node"] = FULL_DISK_NODE
        ballast = self.mounted / "ballast"
        st = os.statvfs(self.mounted)
        free = st.f_bavail * st.f_frsize
        fault["filled_bytes"] = free
        with open(ballast, "wb") as f:
            try:
                os.posix_fallocate(f.fileno(), 0, free)
            except OSError:
                pass  # full: what we wanted
        st = os.statvfs(self.mounted)
        fault["free_left"] = st.f_bavail * st.f_frsize
        held = self.rng.uniform(3.0, 5.0)
        fault["held_s"] = held
        t = time.perf_counter()
        probes = [self.probe() for _ in range(3)]
        fault["probe_ok_while_full"] = sum(probes)
        time.sleep(max(0.0, held - (time.perf_counter() - t)))
        ballast.unlink()
        self.node_recovered(node_id, fault, time.perf_counter())

    def f_slow_disk(self, fault):
        """Throttle one node's writes to its disk (blkio) for a few seconds: strict puts
        there crawl; clients must stay within their request bound and read right bytes."""
        if self.slow_cg is None:
            fault["skipped"] = "no blkio cgroup"
            return
        node_id = fault["node"] = self.rng.choice(
            sorted(n for n in self.nodes if n != FULL_DISK_NODE)
        )
        pid = self.nodes[node_id].proc.pid
        (self.slow_cg / "cgroup.procs").write_text(str(pid))
        held = self.rng.uniform(3.0, 5.0)
        fault["held_s"] = held
        t = time.perf_counter()
        worst = 0.0
        while time.perf_counter() - t < held:
            p0 = time.perf_counter()
            self.probe()
            worst = max(worst, time.perf_counter() - p0)
            time.sleep(0.2)
        fault["slowest_probe_s"] = worst
        (BLKIO / "cgroup.procs").write_text(str(pid))
        self.node_recovered(node_id, fault, time.perf_counter())

    KINDS = (
        "node_kill",
        "leader_kill",
        "sigstop",
        "etcd_restart",
        "graceful_stop",
        "control_cut",
        "data_cut",
        "link_down",
        "full_disk",
        "slow_disk",
    )

    def run_fault(self, kind):
        fault = dict(kind=kind, at=round(time.perf_counter() - self.t_start, 1))
        log(f"fault {len(self.faults) + 1}: {kind}")
        if kind in ("control_cut", "data_cut", "link_down"):
            self.f_link(fault, kind)
        else:
            getattr(self, f"f_{kind}")(fault)
        self.faults.append(fault)
        log(
            f"  {json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in fault.items()})}"
        )
        self.check_processes()

    def check_processes(self):
        for m in self.masters:
            if m.proc.poll() is not None and m.proc.pid not in self.expected_dead:
                self.violations.append(f"master {m.address} exited {m.proc.returncode}")
                self.expected_dead.add(m.proc.pid)
        for node_id, n in self.nodes.items():
            if n.proc.poll() is not None and n.proc.pid not in self.expected_dead:
                self.violations.append(f"{node_id} exited {n.proc.returncode}")
                self.expected_dead.add(n.proc.pid)
        if self.etcd.proc.poll() is not None and self.etcd.proc.pid not in self.expected_dead:
            self.violations.append("etcd exited")
        for c in self.clients:
            if c.poll() not in (None, 0) and c.pid not in self.expected_dead:
                self.violations.append(f"client pid {c.pid} exited {c.returncode}")
                self.expected_dead.add(c.pid)

    # -------------------------------------------------------------- the run

    def run(self):
        self.t_start = time.perf_counter()
        self.setup()
        deadline = self.t_start + self.args.duration
        self.start_sglang()
        fault_end = deadline - 35  # room for the final checks
        client_s = max(10, fault_end - time.perf_counter() + 5)
        for i in range(self.args.clients):
            self.spawn_client(f"raw{i}", client_s, RAW_BUDGET)
        if self.args.ucx:
            # One more raw client reading and writing over UCX (its TCP lanes over the bridge,
            # the INSECURE test hook set in this process, which the client inherits).
            self.spawn_client(
                "ucx0",
                client_s,
                RAW_BUDGET,
                extra=dict(cluster_transport="ucx"),
                env={UCX_HOOK: "1"},
            )
        threads = [
            threading.Thread(target=self.leader_monitor, daemon=True),
            threading.Thread(target=self.killer_loop, args=(client_s,), daemon=True),
            threading.Thread(target=self.sglang_loop, daemon=True),
        ]
        for t in threads:
            t.start()
        time.sleep(3)  # some objects before the first fault
        deck = []
        # The wipe comes early (its precondition, two live copies of everything, is then
        # cheap to check) and before any full disk (whose evictions leave single copies by
        # design, docs/cluster.md "Evictions do not trigger it").
        wipe_at = self.rng.randrange(2, 5)
        while time.perf_counter() < fault_end:
            if not deck:
                deck = list(self.KINDS)
                self.rng.shuffle(deck)
            if len(self.faults) == wipe_at:
                kind = "disk_wipe"
            else:
                kind = deck.pop()
                if kind == "full_disk" and len(self.faults) < wipe_at:
                    deck.insert(0, kind)
                    continue
            self.run_fault(kind)
            time.sleep(self.rng.uniform(0.5, 1.5))
        log("faults over: stopping the clients")
        self.stop_flag.set()
        for t in threads:
            t.join(90)
        for c in self.clients:
            if c.poll() is None:
                c.send_signal(signal.SIGTERM)
        for c in self.clients:
            try:
                c.wait(30)
            except subprocess.TimeoutExpired:
                c.kill()
                c.wait(10)
                self.violations.append(f"client pid {c.pid} did not stop on SIGTERM")
        self.check_processes()
        self.final_check()

    def final_check(self):
        import kvtier
        import numpy as np

        self.wait(
            RECOVERY_LIMIT_S, "three nodes alive at the end", lambda: len(self.alive_nodes()) == 3
        )
        acked, intended, wrong, summaries = self.read_logs()
        for k in wrong:
            self.violations.append(f"raw read of {k}: wrong bytes")
        self.summaries = summaries
        keys = sorted(acked)
        # Informative: objects a full disk evicted keep one copy by design.
        started, short = time.perf_counter(), keys
        while time.perf_counter() - started < RECOVERY_LIMIT_S:
            short = self.under_replicated(keys)
            if not short:
                break
            time.sleep(0.5)
        self.final_replicas_s = time.perf_counter() - started if not short else None
        self.final_single_copy = len(short)
        store = kvtier.Store(json.dumps(store_config(self.joined)))
        lost, bad, misses_unacked, read_unacked = [], [], 0, 0
        check = keys + sorted(intended - acked)
        for i in range(0, len(check), 64):
            chunk = check[i : i + 64]
            dsts = [np.zeros(len(value_of(k)), dtype=np.uint8) for k in chunk]
            ok, _ = store.get_buffers(chunk, dsts)
            for k, o, d in zip(chunk, ok, dsts):
                if o and not np.array_equal(d, value_of(k)):
                    bad.append(k)
                elif not o and k in acked:
                    lost.append(k)
                elif not o:
                    misses_unacked += 1
                elif k not in acked:
                    read_unacked += 1
        store.close()
        for k in bad:
            self.violations.append(f"final read of {k}: wrong bytes")
        if lost:
            self.violations.append(f"{len(lost)} acknowledged raw objects lost, e.g. {lost[:5]}")
        self.final = dict(
            acked_raw=len(acked),
            unacked_attempted=len(intended - acked),
            unacked_found_exact=read_unacked,
            unacked_missing=misses_unacked,
            lost=len(lost),
            wrong=len(bad),
        )
        # The SGLang host's acknowledged pages read back through SGLang's page calls.
        sg_keys = sorted(self.sglang_truth)
        sg_lost = 0
        for i in range(0, len(sg_keys), 16):
            chunk = sg_keys[i : i + 16]
            ok, digests, _ = self.host("v1_read_hashed", keys=chunk, timeout=60)
            for k, o, d in zip(chunk, ok, digests):
                if not o:
                    sg_lost += 1
                elif d != self.sglang_truth[k]:
                    self.violations.append(f"final SGLang read of {k}: wrong bytes")
        if sg_lost:
            self.violations.append(f"{sg_lost} acknowledged SGLang pages lost")
        self.final.update(sglang_acked=len(sg_keys), sglang_lost=sg_lost)
        # Capacity evictions would make losses expected (docs/cluster.md): the budgets are
        # meant to rule them out, so any is reported with the losses (counters since each
        # node's last start; the full disk's recycling on FULL_DISK_NODE counts here too).
        evictions = {}
        for node_id, n in self.nodes.items():
            try:
                doc = n.stat()
            except Exception as e:
                evictions[node_id] = f"stat failed: {e}"
                continue
            found = {"evictions_capacity": 0, "ssd_evicted_objects": 0}

            def walk(v):
                if isinstance(v, dict):
                    for k, x in v.items():
                        if k in found and isinstance(x, int):
                            found[k] += x
                        else:
                            walk(x)
                elif isinstance(v, list):
                    for x in v:
                        walk(x)

            walk(doc)
            evictions[node_id] = found
        self.final["evictions_since_last_start"] = evictions
        if lost or sg_lost:
            self.violations.append(
                f"evictions at the end of the run (since each node's start): {evictions}"
            )
        # Re-replication that found no target (docs/cluster.md "Re-replication"): the largest
        # count a master logged, reported with the recovery figures.
        most = 0
        for path in self.tmp.glob("master-*.log"):
            for line in path.read_text(errors="replace").splitlines():
                if "under-replicated objects have no target node" in line:
                    words = line.split("re-replication: ", 1)[-1].split()
                    if words and words[0].isdigit():
                        most = max(most, int(words[0]))
        self.final["most_without_target"] = most
        for path in sorted(self.tmp.rglob("*.log")) + sorted(self.tmp.glob("*.err")):
            text = path.read_text(errors="replace")
            if "panicked" in text:
                self.violations.append(f"a panic in {path.name}")

    def teardown(self):
        self.stop_flag.set()
        if self.host is not None:
            self.host.proc.kill()
            self.host.proc.join(10)
        for c in self.clients:
            if c.poll() is None:
                c.kill()
                c.wait(10)
        for n in self.nodes.values():
            try:
                n.stop()
            except Exception:
                pass
        for m in self.masters:
            try:
                m.stop()
            except Exception:
                pass
        if self.etcd is not None:
            self.etcd.stop()
        if getattr(self, "mounted", None):
            subprocess.run(["umount", str(self.mounted)], capture_output=True, timeout=10)
        if getattr(self, "slow_cg", None):
            try:
                self.slow_cg.rmdir()
            except OSError as e:
                print(f"chaos_soak: could not remove {self.slow_cg}: {e}", file=sys.stderr)
        for ns in self.netns.values():
            ns.remove()
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=10)

    def report(self):
        by_kind: dict[str, list] = {}
        for f in self.faults:
            by_kind.setdefault(f["kind"], []).append(f)

        def span(values):
            vs = [v for v in values if isinstance(v, (int, float))]
            return f"{min(vs):.2f}-{max(vs):.2f} s" if vs else "-"

        raw = dict(puts=0, put_ok=0, put_fail=0, gets=0, get_hit=0, get_miss=0, wrong=0, exists=0)
        errors: dict[str, int] = {}
        examples: dict[str, str] = {}
        for s in getattr(self, "summaries", []):
            for k, v in s["counts"].items():
                raw[k] += v
            for k, v in s["errors"].items():
                errors[k] = errors.get(k, 0) + v
            for k, v in s.get("examples", {}).items():
                examples.setdefault(k, v)
        doc = dict(
            seed=self.args.seed,
            duration_s=round(time.perf_counter() - self.t_start, 1),
            faults=len(self.faults),
            client_kills=self.client_kills,
            raw_ops=raw,
            raw_errors=errors,
            raw_error_examples=examples,
            sglang_ops=self.sglang,
            leader_samples=self.leader_samples,
            no_leader_samples=self.no_leader_samples,
            final=getattr(self, "final", None),
            final_replicas_s=getattr(self, "final_replicas_s", None),
            final_single_copy=getattr(self, "final_single_copy", None),
            fault_list=self.faults,
            violations=self.violations,
            notes=self.notes[:20],
            workdir=str(self.tmp),
        )
        # Each raw "no room" put error against the last change of leadership before it.
        after = []
        for t in getattr(self, "no_room_at", []):
            before = [c for c in self.leader_changes if c <= t]
            after.append(round(t - before[-1], 3) if before else 1e9)
        doc["no_room_after_leader_change_s"] = sorted(after)
        (self.tmp / "report.json").write_text(json.dumps(doc, indent=2))
        print("\n=== chaos soak report ===")
        print(
            f"seed {self.args.seed}, {doc['duration_s']} s, {len(self.faults)} faults + {self.client_kills} client SIGKILLs mid-batch"
        )
        print(f"raw clients (kvtier.Store): {raw}")
        print(f"  errors by kind: {errors}")
        for k, v in examples.items():
            print(f"    e.g. {k}: {v}")
        for sm in getattr(self, "summaries", []):
            if sm.get("transports") and not sm["name"].startswith("killed"):
                used = sorted({t for _, t in sm["transports"]})
                print(f"  {sm['name']} read from {len(sm['transports'])} peers over {used}")
        if after:
            within = sum(1 for a in after if a <= 2.0)
            print(
                f"  'no room' put errors: {len(after)}, {within} of them within 2 s of a "
                f"leadership change (the latest {max(after):.2f} s after one)"
            )
        print(f"SGLang host (batch_set_v1/batch_get_v1): {self.sglang}")
        print(
            f"leader samples: {self.leader_samples}, of which without a leader: {self.no_leader_samples}"
        )
        fields = (
            "slowest_probe_s",
            "probe_ok_while_full",
            "leader_back_s",
            "node_back_s",
            "rw_back_s",
            "replicas_after_death_s",
            "replicas_restored_s",
            "stop_s",
        )
        for kind, fs in sorted(by_kind.items()):
            parts = [
                f"{f}: {span(x.get(f) for x in fs)}" for f in fields if any(f in x for x in fs)
            ]
            skipped = sum(1 for x in fs if "skipped" in x)
            print(
                f"  {kind:14s} x{len(fs)}"
                + (f" ({skipped} skipped)" if skipped else "")
                + "  "
                + ", ".join(parts)
            )
        print(f"final: {doc['final']}")
        print(
            f"  at the end: every acknowledged object with two live copies after "
            f"{doc['final_replicas_s']} s (objects still below two: {doc['final_single_copy']})"
        )
        for n in doc["notes"]:
            print(f"note: {n}")
        for v in self.violations:
            print(f"VIOLATION: {v}")
        print(f"report: {self.tmp / 'report.json'}")
        return not self.violations


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd")
    c = sub.add_parser("client")
    c.add_argument("--name", required=True)
    c.add_argument("--masters", required=True)
    c.add_argument("--log", required=True)
    c.add_argument("--seed", type=int, required=True)
    c.add_argument("--seconds", type=float, required=True)
    c.add_argument("--batch-min", type=int, default=1)
    c.add_argument("--batch-max", type=int, default=8)
    c.add_argument("--pause", type=float, default=0.02)
    c.add_argument("--extra", default="{}")
    c.add_argument("--max-bytes", type=int, default=1 << 40)
    ap.add_argument("--seed", type=int, default=int(time.time()) % 100000)
    ap.add_argument(
        "--duration", type=float, default=150, help="seconds, setup and checks included"
    )
    ap.add_argument("--clients", type=int, default=3, help="raw client processes")
    ap.add_argument("--binary", default=str(ROOT / "target" / "release" / "kvtier"))
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument(
        "--no-ucx",
        dest="ucx",
        action="store_false",
        help="nodes and clients on kvtier's TCP frames only (default: nodes offer UCX and one "
        "client uses it)",
    )
    args = ap.parse_args()
    if args.cmd == "client":
        client_main(args)
        return 0
    if os.geteuid() != 0:
        print("chaos_soak: needs root (network namespaces, a bridge)", file=sys.stderr)
        return 2
    log(f"seed {args.seed}, duration {args.duration:.0f} s (replay: --seed {args.seed})")
    soak = Soak(args)
    ok = False

    def terminated(signum, frame):
        # SIGTERM (a CI timeout) ends the run through the same teardown as a failure.
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, terminated)
    try:
        soak.run()
    except BaseException as e:
        soak.violations.append(f"the soak itself failed: {type(e).__name__}: {e}")
        import traceback

        traceback.print_exc()
    finally:
        soak.teardown()
        ok = soak.report()
        if ok and not args.keep:
            shutil.rmtree(soak.tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
