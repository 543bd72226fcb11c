"""A simulated multi-turn chat workload on a DeepSeek-V4-style hybrid model, through kvtier's
real SGLang backend (embedded mode).

    python -m kvtier_dev.demo [--users 16] [--turns 8] [--dram 32MiB] [--seed 0]

What runs: SGLang 0.5.23's real host pools built on CPU (a ``HostPoolGroup`` with a logical KV
anchor plus SWA, compressed-KV, indexer and compressor-state side pools), and SGLang's real
controller methods for the hit query, the prefetch and the backup
(``kvtier_dev.harness.flows``). The trace: a few shared system prompts, many users, each turn
extending the user's conversation; every turn first asks L3 for the longest restorable prefix,
loads it, then backs up the pages it "computed". The DRAM budget is smaller than the working
set, so eviction decides what survives; the run is repeated for the ``prefix_depth`` and
``lru`` policies on the same trace. Every restored page is compared with the bytes written
for its hash: a mismatch would be counted (and fail the run).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from typing import Dict, List

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

DYNAMIC = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore"}


@dataclass
class Conversation:
    system: int
    turns_done: int = 0


@dataclass
class Trace:
    """Span of page hashes for every (user, turn) in the order they run."""

    spans: List[List[str]]
    page_size: int


def chain(parent: str, label: str) -> str:
    return hashlib.sha256(f"{parent}/{label}".encode()).hexdigest()[:32]


def make_trace(
    users: int,
    turns: int,
    systems: int,
    system_pages: int,
    turn_pages: int,
    page_size: int,
    seed: int,
) -> Trace:
    """Shared system prompts, growing conversations; users interleave turn by turn at random."""
    rng = random.Random(seed)
    system_chains = []
    for s in range(systems):
        h, pages = "root", []
        for p in range(system_pages):
            h = chain(h, f"sys{s}.{p}")
            pages.append(h)
        system_chains.append(pages)
    convs = [Conversation(system=rng.randrange(systems)) for _ in range(users)]
    history: Dict[int, List[str]] = {u: list(system_chains[c.system]) for u, c in enumerate(convs)}
    order = [u for u in range(users) for _ in range(turns)]
    rng.shuffle(order)
    spans = []
    for u in order:
        pages = history[u]
        h = pages[-1]
        for p in range(rng.randint(1, turn_pages)):
            h = chain(h, f"user{u}.turn{convs[u].turns_done}.{p}")
            pages.append(h)
        convs[u].turns_done += 1
        spans.append(list(pages))
    return Trace(spans, page_size)


@dataclass
class RunResult:
    policy: str
    pages_asked: int = 0
    pages_hit: int = 0
    pages_backed_up: int = 0
    bytes_loaded: int = 0
    bytes_stored: int = 0
    wrong_pages: int = 0
    seconds_io: float = 0.0
    stats: dict = field(default_factory=dict)

    @property
    def hit_rate(self) -> float:
        return self.pages_hit / self.pages_asked if self.pages_asked else 0.0


def _page_bytes(pool, page_hash: str) -> bytes:
    from kvtier_dev.harness.pools import page_pattern

    return page_pattern(pool, int(page_hash[:8], 16), 0)


def _fill(pool, indices, hashes) -> int:
    """Write each page's hash-derived bytes; returns bytes written."""
    from kvtier_dev.harness.pools import _bytes_to_page, page_starts

    total = 0
    for start, h in zip(page_starts(pool, indices), hashes):
        data = _page_bytes(pool, h)
        if data:
            pool.set_from_flat_data_page(start, _bytes_to_page(pool, data))
            total += len(data)
    return total


def _verify(pool, indices, hashes, count) -> tuple[int, int]:
    """(wrong pages, bytes checked) over the first ``count`` restored pages."""
    from kvtier_dev.harness.pools import page_starts

    wrong = checked = 0
    for start, h in list(zip(page_starts(pool, indices), hashes))[:count]:
        want = _page_bytes(pool, h)
        if not want:
            continue
        got = (
            pool.get_data_page(start, flat=True)
            .contiguous()
            .view(__import__("torch").uint8)
            .numpy()
            .tobytes()
        )
        wrong += got != want
        checked += len(want)
    return wrong, checked


def run_policy(trace: Trace, policy: str, dram: str, quiet: bool) -> RunResult:
    from sglang.srt.mem_cache.hicache_storage import PoolName

    from kvtier_dev.harness import flows
    from kvtier_dev.harness.pools import build_dsv4_pool_group, make_storage_config

    dsv4 = build_dsv4_pool_group("page_first", device_full_pages=32, device_swa_pages=8)
    extra = {**DYNAMIC, "interface_v1": 1, "dram_capacity_bytes": dram, "eviction_policy": policy}
    cfg = make_storage_config(is_mla=True, model_name="demo/deepseek-v4", extra_config=extra)
    backend = flows.create_backend("dynamic", cfg, dsv4)
    flows.attach_backend(backend, dsv4)
    swa = dsv4.spec(PoolName.SWA).host_pool
    window = dsv4.window_pages
    ps = dsv4.page_size
    by_source = {
        PoolName.KV: [s for s in dsv4.side_specs if s.indices_from_pool == PoolName.KV],
        PoolName.SWA: [
            s
            for s in dsv4.side_specs
            if s.name == PoolName.SWA or s.indices_from_pool == PoolName.SWA
        ],
    }
    result = RunResult(policy)
    for turn, span in enumerate(trace.spans):
        started = time.perf_counter()
        pre = flows.prefetch_span(backend, dsv4, span, prefix_keys=[], storage_config=cfg)
        result.seconds_io += time.perf_counter() - started
        hit = pre.hit_pages
        result.pages_asked += len(span)
        result.pages_hit += hit
        if hit:
            for name, count in pre.counts.items():
                if name == PoolName.KV or count == 0:
                    continue
                pool = dsv4.spec(name).host_pool
                wrong, checked = _verify(pool, pre.host_indices[name], pre.key_ranges[name], count)
                result.wrong_pages += wrong
                result.bytes_loaded += checked
            dsv4.anchor.free(pre.host_indices[PoolName.KV])
            if PoolName.SWA in pre.host_indices and pre.host_indices[PoolName.SWA] is not None:
                swa.free(pre.host_indices[PoolName.SWA])
        new = span[hit:]
        if new:
            kv_idx = dsv4.anchor.alloc(len(new) * ps)
            n_swa = min(len(new), window)
            swa_idx = swa.alloc(n_swa * ps)
            for spec in by_source[PoolName.KV]:
                result.bytes_stored += _fill(spec.host_pool, kv_idx, new)
            for spec in by_source[PoolName.SWA]:
                result.bytes_stored += _fill(spec.host_pool, swa_idx, new[-n_swa:])
            started = time.perf_counter()
            flows.backup_span(
                backend,
                dsv4,
                new,
                {PoolName.KV: kv_idx, PoolName.SWA: swa_idx},
                prefix_keys=span[:hit],
                storage_config=cfg,
            )
            result.seconds_io += time.perf_counter() - started
            result.pages_backed_up += len(new)
            dsv4.anchor.free(kv_idx)
            swa.free(swa_idx)
        if not quiet and (turn + 1) % max(1, len(trace.spans) // 6) == 0:
            print(
                f"  [{policy:>12}] turn {turn + 1:4d}/{len(trace.spans)}: span {len(span):3d} pages, hit {hit:3d}; "
                f"running hit rate {result.hit_rate:6.1%}"
            )
    result.stats = backend.get_stats().as_dict() if hasattr(backend.get_stats(), "as_dict") else {}
    backend.close()
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvtier_dev.demo", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--users", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--systems", type=int, default=3, help="shared system prompts")
    ap.add_argument("--system-pages", type=int, default=4)
    ap.add_argument("--turn-pages", type=int, default=3, help="max new pages per turn")
    ap.add_argument(
        "--dram", default="32MiB", help="kvtier DRAM budget (the working set is larger)"
    )
    ap.add_argument("--policies", default="prefix_depth,lru")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--quiet", action="store_true")
    args = ap.parse_args(argv)

    import kvtier

    trace = make_trace(
        args.users, args.turns, args.systems, args.system_pages, args.turn_pages, 256, args.seed
    )
    unique = len({h for s in trace.spans for h in s})
    print(
        f"kvtier {kvtier.__version__} demo: DeepSeek-V4-style pool group (logical anchor + SWA, C4, C4 indexer, "
        f"C128, C4 state, C4 indexer state), {args.users} users x {args.turns} turns, {args.systems} system prompts, "
        f"{len(trace.spans)} requests over {unique} distinct pages; DRAM budget {args.dram}"
    )
    results = []
    for policy in args.policies.split(","):
        results.append(run_policy(trace, policy.strip(), args.dram, args.quiet))

    print()
    print(
        f"{'policy':>13} | {'page hit rate':>13} | {'pages hit':>9} | {'backed up':>9} | {'GB loaded':>9} | {'GB stored':>9} | {'I/O GB/s':>8} | {'evictions':>9} | wrong pages"
    )
    print("-" * 112)
    for r in results:
        moved = r.bytes_loaded + r.bytes_stored
        gbps = moved / r.seconds_io / 1e9 if r.seconds_io else 0.0
        print(
            f"{r.policy:>13} | {r.hit_rate:13.1%} | {r.pages_hit:9d} | {r.pages_backed_up:9d} | {r.bytes_loaded / 1e9:9.3f} | "
            f"{r.bytes_stored / 1e9:9.3f} | {gbps:8.2f} | {r.stats.get('evictions_capacity', 0):9d} | {r.wrong_pages}"
        )
    print(
        "\nI/O GB/s counts the bytes the SGLang flows moved (prefetch + backup, including SGLang's own Python "
        "work per call) over the time spent in them."
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                [r.__dict__ | {"hit_rate": r.hit_rate} for r in results], f, indent=2, default=str
            )
    if any(r.wrong_pages for r in results):
        print("ERROR: some restored pages did not match what was written", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
