"""``python -m kvtier_dev.bench workload``: a multi-turn chat trace through kvtier's real SGLang
backend, prefix-depth vs LRU eviction over several DRAM budgets.

What runs: kvtier's ``KvtierStore`` (embedded mode, created by SGLang's own
``StorageBackendFactory`` as a dynamic backend), SGLang 0.5.23's real DeepSeek-V4 host pool
group built on CPU (a logical KV anchor plus SWA, C4, C4 indexer, C128, C4 state and C4
indexer state pools; ``kvtier_dev.harness.pools``), and SGLang's real controller methods for the
existence query, the prefetch and the backup (``kvtier_dev.harness.flows``). Only L3 is modelled:
every request asks kvtier for its longest restorable prefix, loads it, then backs up the pages
it had to compute, as if SGLang's GPU and host caches had already dropped them.

The trace (``make_trace``, deterministic for a seed):

- ``systems`` shared system prompts of ``system_pages`` pages each; a new user picks one with
  Zipf weights ``1/(rank+1)`` (a few prompts are very popular);
- ``users`` conversations; each has ``turns`` turns and every turn appends 1..``turn_pages``
  new pages (user message + reply) to that user's conversation, plus an uncacheable partial
  page of 0..page_size-1 tokens (SGLang stores only whole pages);
- a request is the whole conversation so far (system prompt + every earlier turn + the new
  turn); users interleave at random (a shuffle of every user's turns, each user's turns kept
  in order), so the working set is every active conversation.

Reported per (policy, DRAM budget): token hit rate (restored tokens / prompt tokens), mean
restorable prefix (pages restored per request), bytes loaded and stored by the flows, objects
and page groups evicted; every restored page is compared with the bytes written for its hash
(a mismatch fails the run). Both policies replay the same trace on a fresh store per budget.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Dict, List, Optional, Sequence

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

DYNAMIC = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore"}
MIB = 1 << 20


@dataclass(frozen=True)
class TraceShape:
    users: int = 24
    turns: int = 6
    systems: int = 4
    system_pages: int = 4
    turn_pages: int = 3
    page_size: int = 256
    seed: int = 0


QUICK_SHAPE = TraceShape(users=6, turns=3, systems=2, system_pages=2, turn_pages=2)
DEFAULT_BUDGETS_MIB = (8, 12, 16, 24, 32, 48, 64)
# One trace has 144 requests: a single request's hit moves the rate by ~0.6 points, so the
# comparison is made on the mean of several traces.
DEFAULT_SEEDS = (0, 1, 2)
QUICK_BUDGETS_MIB = (6,)


@dataclass
class Request:
    user: int
    pages: List[str]  # the conversation's page hashes, in chain order
    tail_tokens: int  # uncacheable partial page


def _chain(parent: str, label: str) -> str:
    return hashlib.sha256(f"{parent}/{label}".encode()).hexdigest()[:32]


def make_trace(shape: TraceShape) -> List[Request]:
    """The request sequence of ``shape`` (see the module docstring)."""
    rng = random.Random(shape.seed)
    systems = []
    for s in range(shape.systems):
        h, pages = "root", []
        for p in range(shape.system_pages):
            h = _chain(h, f"sys{s}.{p}")
            pages.append(h)
        systems.append(pages)
    weights = [1.0 / (r + 1) for r in range(shape.systems)]
    history: Dict[int, List[str]] = {
        u: list(rng.choices(systems, weights)[0]) for u in range(shape.users)
    }
    done = {u: 0 for u in range(shape.users)}
    order = [u for u in range(shape.users) for _ in range(shape.turns)]
    rng.shuffle(order)
    trace = []
    for u in order:
        pages = history[u]
        h = pages[-1]
        for p in range(rng.randint(1, shape.turn_pages)):
            h = _chain(h, f"user{u}.turn{done[u]}.{p}")
            pages.append(h)
        done[u] += 1
        trace.append(Request(u, list(pages), rng.randrange(shape.page_size)))
    return trace


@dataclass
class RunResult:
    policy: str
    dram_mib: float
    seed: int = 0
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    pages_asked: int = 0
    pages_hit: int = 0
    pages_backed_up: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    wrong_pages: int = 0
    evicted_objects: int = 0
    evicted_groups: int = 0
    seconds: float = 0.0
    stats: dict = field(default_factory=dict)

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def mean_restorable_pages(self) -> float:
        return self.pages_hit / self.requests if self.requests else 0.0

    def as_dict(self) -> dict:
        d = asdict(self)
        d["token_hit_rate"] = self.token_hit_rate
        d["mean_restorable_pages"] = self.mean_restorable_pages
        return d


def build_pools():
    from kvtier_dev.harness.pools import build_dsv4_pool_group

    return build_dsv4_pool_group("page_first", device_full_pages=32, device_swa_pages=8)


def open_backend(dsv4, policy: str, dram_mib: float, window: Optional[int] = None):
    """A fresh kvtier backend (SGLang's dynamic factory) attached to ``dsv4``, and its
    storage config: ``(backend, cfg)``."""
    from kvtier_dev.harness import flows
    from kvtier_dev.harness.pools import make_storage_config

    extra = {
        **DYNAMIC,
        "interface_v1": 1,
        "dram_capacity_bytes": int(dram_mib * MIB),
        "eviction_policy": policy,
    }
    if window is not None:
        extra["eviction_candidate_window"] = window
    cfg = make_storage_config(is_mla=True, model_name="bench/deepseek-v4", extra_config=extra)
    backend = flows.create_backend("dynamic", cfg, dsv4)
    flows.attach_backend(backend, dsv4)
    return backend, cfg


def serve_request(backend, cfg, dsv4, span: Sequence[str], r: "RunResult", tail_tokens=0) -> int:
    """One request for the conversation ``span``: ask for its longest restorable prefix,
    load and verify it, back up the rest (as if SGLang's GPU and host caches had dropped
    it). Adds to ``r``; returns the pages restored."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from kvtier_dev.demo import _fill, _verify
    from kvtier_dev.harness import flows

    swa = dsv4.spec(PoolName.SWA).host_pool
    swa_window, ps = dsv4.window_pages, dsv4.page_size
    kv_side = [s for s in dsv4.side_specs if s.indices_from_pool == PoolName.KV]
    swa_side = [
        s for s in dsv4.side_specs if s.name == PoolName.SWA or s.indices_from_pool == PoolName.SWA
    ]
    span = list(span)
    pre = flows.prefetch_span(backend, dsv4, span, prefix_keys=[], storage_config=cfg)
    hit = pre.hit_pages
    r.requests += 1
    r.pages_asked += len(span)
    r.pages_hit += hit
    r.prompt_tokens += len(span) * ps + tail_tokens
    r.hit_tokens += hit * ps
    if hit:
        for name, count in pre.counts.items():
            if name == PoolName.KV or count == 0:
                continue
            pool = dsv4.spec(name).host_pool
            wrong, checked = _verify(pool, pre.host_indices[name], pre.key_ranges[name], count)
            r.wrong_pages += wrong
            r.bytes_loaded += checked
        dsv4.anchor.free(pre.host_indices[PoolName.KV])
        if pre.host_indices.get(PoolName.SWA) is not None:
            swa.free(pre.host_indices[PoolName.SWA])
    new = span[hit:]
    if not new:
        return hit
    kv_idx = dsv4.anchor.alloc(len(new) * ps)
    n_swa = min(len(new), swa_window)
    swa_idx = swa.alloc(n_swa * ps)
    for spec in kv_side:
        r.bytes_stored += _fill(spec.host_pool, kv_idx, new)
    for spec in swa_side:
        r.bytes_stored += _fill(spec.host_pool, swa_idx, new[-n_swa:])
    flows.backup_span(
        backend,
        dsv4,
        new,
        {PoolName.KV: kv_idx, PoolName.SWA: swa_idx},
        prefix_keys=span[:hit],
        storage_config=cfg,
    )
    r.pages_backed_up += len(new)
    dsv4.anchor.free(kv_idx)
    swa.free(swa_idx)
    return hit


def run_policy(
    dsv4,
    trace: Sequence[Request],
    policy: str,
    dram_mib: float,
    window: Optional[int] = None,
    seed: int = 0,
) -> RunResult:
    """Replay ``trace`` through a fresh kvtier store of ``dram_mib`` MiB with ``policy``
    (``window``: the engine's ``eviction_candidate_window``, its default when None)."""
    backend, cfg = open_backend(dsv4, policy, dram_mib, window)
    r = RunResult(policy, dram_mib, seed)
    started = time.perf_counter()
    try:
        for req in trace:
            serve_request(backend, cfg, dsv4, req.pages, r, req.tail_tokens)
    finally:
        r.seconds = time.perf_counter() - started
        store = backend._store
        r.stats = dict(store.stats())
        r.evicted_objects = int(r.stats.get("evictions_capacity", 0))
        groups = store.group_stats()
        r.evicted_groups = int(groups[0]) if groups else 0
        backend.close()
    return r


def working_set_bytes(dsv4, trace: Sequence[Request]) -> int:
    """Bytes kvtier would hold if nothing were evicted: every distinct page's KV-derived
    components, plus the SWA-derived ones for the pages that end a backed-up span."""
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from kvtier_dev.harness.pools import page_nbytes

    kv_bytes = sum(
        page_nbytes(s.host_pool) for s in dsv4.side_specs if s.indices_from_pool == PoolName.KV
    )
    swa_bytes = sum(
        page_nbytes(s.host_pool)
        for s in dsv4.side_specs
        if s.name == PoolName.SWA or s.indices_from_pool == PoolName.SWA
    )
    pages = {h for req in trace for h in req.pages}
    # Without eviction each request backs up only its new pages: its last `window` pages get
    # the SWA-derived components.
    window = dsv4.window_pages
    seen: set = set()
    trailing: set = set()
    for req in trace:
        new = [h for h in req.pages if h not in seen]
        seen.update(new)
        trailing.update(new[-window:])
    return len(pages) * kv_bytes + len(trailing) * swa_bytes


def run(
    shape: TraceShape,
    budgets_mib: Sequence[float],
    policies: Sequence[str] = ("prefix_depth", "lru"),
    progress=None,
    window: Optional[int] = None,
    seeds: Optional[Sequence[int]] = None,
) -> dict:
    """Replay the trace of ``shape`` once per seed (default: ``shape.seed``) through every
    (budget, policy). Top-level trace figures are the first seed's; ``traces`` has each."""
    import kvtier

    seeds = list(seeds) if seeds else [shape.seed]
    dsv4 = build_pools()
    traces = {}
    results = []
    for seed in seeds:
        seeded = replace(shape, seed=seed)
        trace = make_trace(seeded)
        traces[seed] = {
            "requests": len(trace),
            "distinct_pages": len({h for req in trace for h in req.pages}),
            "prompt_tokens": sum(len(r.pages) * shape.page_size + r.tail_tokens for r in trace),
            "working_set_bytes": working_set_bytes(dsv4, trace),
        }
        for budget in budgets_mib:
            for policy in policies:
                res = run_policy(dsv4, trace, policy, budget, window, seed)
                results.append(res)
                if progress:
                    progress(
                        f"seed {seed} {policy:>12} @ {budget:g} MiB: token hit rate "
                        f"{res.token_hit_rate:.1%}, {res.seconds:.1f} s"
                    )
    first = traces[seeds[0]]
    return {
        "kvtier_version": kvtier.__version__,
        "shape": asdict(replace(shape, seed=seeds[0])),
        "seeds": seeds,
        "traces": {str(k): v for k, v in traces.items()},
        **first,
        "budgets_mib": list(budgets_mib),
        "policies": list(policies),
        "eviction_candidate_window": window,
        "results": [r.as_dict() for r in results],
    }


def summary(report: dict) -> Dict[tuple, dict]:
    """Per (budget, policy): the token hit rate of each seed, their mean, and the means of
    the restorable prefix and of the bytes moved."""
    out: Dict[tuple, dict] = {}
    for r in report["results"]:
        e = out.setdefault(
            (r["dram_mib"], r["policy"]),
            {"rates": [], "pages": [], "loaded": [], "stored": []},
        )
        e["rates"].append(r["token_hit_rate"])
        e["pages"].append(r["mean_restorable_pages"])
        e["loaded"].append(r["bytes_loaded"])
        e["stored"].append(r["bytes_stored"])
    for e in out.values():
        for k in ("rates", "pages", "loaded", "stored"):
            e["mean_" + k] = sum(e[k]) / len(e[k])
    return out


def verdicts(report: dict) -> List[tuple]:
    """Per budget, when both policies ran: (budget, prefix_depth mean - lru mean in points,
    seeds where prefix_depth was ahead, seeds)."""
    if not {"prefix_depth", "lru"} <= set(report["policies"]):
        return []
    s = summary(report)
    out = []
    for b in report["budgets_mib"]:
        pd, lru = s[(b, "prefix_depth")], s[(b, "lru")]
        ahead = sum(1 for x, y in zip(pd["rates"], lru["rates"]) if x > y)
        out.append((b, 100 * (pd["mean_rates"] - lru["mean_rates"]), ahead, len(pd["rates"])))
    return out


def table(report: dict) -> str:
    """A markdown table: one row per budget, the policies side by side (means over the
    seeds; the per-seed hit rates in parentheses when there are several)."""
    s = summary(report)
    pols = report["policies"]
    many = len(report.get("seeds", [0])) > 1
    head = ["DRAM budget", "% of working set"]
    for p in pols:
        head += [f"{p} token hit", f"{p} restorable pages", f"{p} GB loaded / stored"]
    verdict = {v[0]: v for v in verdicts(report)}
    if verdict:
        head += ["prefix_depth - lru", "seeds ahead"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    traces = report.get("traces") or {"0": {"working_set_bytes": report["working_set_bytes"]}}
    ws = sum(t["working_set_bytes"] for t in traces.values()) / len(traces)
    for b in report["budgets_mib"]:
        row = [f"{b:g} MiB", f"{b * MIB / ws:.0%}"]
        for p in pols:
            e = s[(b, p)]
            rate = f"{e['mean_rates']:.1%}"
            if many:
                rate += " (" + " / ".join(f"{x:.1%}" for x in e["rates"]) + ")"
            row += [
                rate,
                f"{e['mean_pages']:.2f}",
                f"{e['mean_loaded'] / 1e9:.3f} / {e['mean_stored'] / 1e9:.3f}",
            ]
        if verdict:
            _, diff, ahead, n = verdict[b]
            row += [f"{diff:+.1f} points", f"{ahead}/{n}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(report: dict, path: str) -> None:
    """Token hit rate vs DRAM budget, one line per policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
    ws = report["working_set_bytes"] / MIB
    stats = summary(report)
    for p in report["policies"]:
        xs = sorted(b for (b, q) in stats if q == p)
        mean = [stats[(x, p)]["mean_rates"] * 100 for x in xs]
        (line,) = ax.plot(xs, mean, marker="o", label=p)
        if len(report.get("seeds", [0])) > 1:
            lo = [min(stats[(x, p)]["rates"]) * 100 for x in xs]
            hi = [max(stats[(x, p)]["rates"]) * 100 for x in xs]
            ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.15)
    ax.set_xlabel(f"kvtier DRAM budget (MiB; working set {ws:.0f} MiB)")
    ax.set_ylabel("token hit rate (%)")
    s = report["shape"]
    seeds = report.get("seeds", [s["seed"]])
    what = f"seed {seeds[0]}" if len(seeds) == 1 else f"mean of seeds {seeds}, band = range"
    ax.set_title(
        f"multi-turn chat, DeepSeek-V4 pool group: {s['users']} users x {s['turns']} turns, {what}",
        fontsize=9,
    )
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def add_arguments(p) -> None:
    d = TraceShape()
    p.add_argument("--quick", action="store_true", help="a few seconds: tiny trace, one budget")
    p.add_argument("--users", type=int, default=None, help=f"conversations (default {d.users})")
    p.add_argument("--turns", type=int, default=None, help=f"turns per user ({d.turns})")
    p.add_argument("--systems", type=int, default=None, help=f"system prompts ({d.systems})")
    p.add_argument(
        "--system-pages", type=int, default=None, help=f"pages per prompt ({d.system_pages})"
    )
    p.add_argument(
        "--turn-pages", type=int, default=None, help=f"max new pages per turn ({d.turn_pages})"
    )
    p.add_argument("--seed", type=int, default=None, help="one trace seed (same as --seeds N)")
    p.add_argument(
        "--seeds",
        default=None,
        help="comma-separated trace seeds, each replayed through every budget and policy "
        "(default " + ",".join(map(str, DEFAULT_SEEDS)) + "; --quick: 0)",
    )
    p.add_argument(
        "--budgets",
        default=None,
        help="comma-separated DRAM budgets in MiB (default "
        + ",".join(map(str, DEFAULT_BUDGETS_MIB))
        + ")",
    )
    p.add_argument("--policies", default="prefix_depth,lru")
    p.add_argument(
        "--window",
        type=int,
        default=None,
        help="the engine's eviction_candidate_window (default: the engine's default)",
    )
    p.add_argument("--json", metavar="PATH", help="write every figure as JSON")
    p.add_argument("--png", metavar="PATH", help="write the hit-rate plot (PNG) here")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")


def main(args) -> int:
    base = QUICK_SHAPE if args.quick else TraceShape()
    overrides = {
        k: v
        for k, v in dict(
            users=args.users,
            turns=args.turns,
            systems=args.systems,
            system_pages=args.system_pages,
            turn_pages=args.turn_pages,
        ).items()
        if v is not None
    }
    shape = TraceShape(**{**asdict(base), **overrides})
    if args.budgets:
        try:
            budgets = [float(b) for b in args.budgets.split(",") if b.strip()]
        except ValueError:
            print(f"--budgets: not a list of numbers: {args.budgets!r}", file=sys.stderr)
            return 2
    else:
        budgets = list(QUICK_BUDGETS_MIB if args.quick else DEFAULT_BUDGETS_MIB)
    if not budgets or any(b <= 0 for b in budgets):
        print("--budgets: every budget must be a positive number of MiB", file=sys.stderr)
        return 2
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[kvtier_dev.bench workload] {msg}", file=sys.stderr, flush=True)

    if args.window is not None and args.window <= 0:
        print("--window: must be a positive number of page groups", file=sys.stderr)
        return 2
    if args.seed is not None and args.seeds:
        print("--seed and --seeds: give one of them", file=sys.stderr)
        return 2
    if args.seeds:
        try:
            seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
        except ValueError:
            print(f"--seeds: not a list of integers: {args.seeds!r}", file=sys.stderr)
            return 2
        if not seeds or len(set(seeds)) != len(seeds):
            print("--seeds: give distinct seeds", file=sys.stderr)
            return 2
    elif args.seed is not None:
        seeds = [args.seed]
    else:
        seeds = [base.seed] if args.quick else list(DEFAULT_SEEDS)
    report = run(shape, budgets, policies, progress, args.window, seeds)
    print(
        f"kvtier {report['kvtier_version']} workload: {shape.users} users x {shape.turns} turns, "
        f"{shape.systems} system prompts of {shape.system_pages} pages, <= {shape.turn_pages} "
        f"new pages per turn, page {shape.page_size} tokens"
    )
    for seed, t in report["traces"].items():
        print(
            f"  seed {seed}: {t['requests']} requests, {t['distinct_pages']} distinct pages, "
            f"{t['prompt_tokens']} prompt tokens, working set {t['working_set_bytes'] / MIB:.1f} MiB"
        )
    print()
    print(table(report))
    behind = [v for v in verdicts(report) if v[1] <= 0]
    if verdicts(report):
        print()
        print(
            "prefix_depth ahead of lru on the mean token hit rate at every budget"
            if not behind
            else "prefix_depth NOT ahead of lru (mean) at "
            + ", ".join(f"{b:g} MiB ({d:+.1f} points)" for b, d, _, _ in behind)
        )
    wrong = sum(r["wrong_pages"] for r in report["results"])
    print()
    print(f"restored pages that did not match what was written: {wrong}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        progress(f"wrote {args.json}")
    if args.png:
        plot(report, args.png)
        progress(f"wrote {args.png}")
    return 1 if wrong else 0


def _standalone(argv: Optional[List[str]] = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m kvtier_dev.bench.workload", description=__doc__)
    add_arguments(p)
    return main(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(_standalone())
