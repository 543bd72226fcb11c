"""Benchmark of kvtier as SGLang's direct L3 (issue 18): a layer-wise load of N pages x L
layers through the real chain (``kvtier_dev.harness.linker_flow``: SGLang's factory, tree, linker
wrapper and CPU device pools), against the same run's memcpy of the same bytes; and offload
throughput.

    python -m kvtier_dev.bench.linker --pages 16 64 --layers 32 --reps 3

For each page count, every repetition produces fresh pages (their offload is timed from the
insert until ``check_hicache_events`` committed it), drops them from the device, and restores
them: *first layer* is the time from ``ready_to_load_host_cache`` until the forward's wait on
layer 0 returns, *total* until ``finish_external_linker_loads`` returns. The memcpy baseline
copies the same number of bytes between two CPU tensors in this process, once as one copy
(``memcpy total``) and as one layer's share (``memcpy layer``). Medians of ``--reps``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvtier_dev.harness import linker_flow as lf


def _memcpy_s(nbytes: int, reps: int) -> float:
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
    dst = torch.zeros_like(src)  # pre-faulted, as the device pools are
    times = []
    for _ in range(max(3, reps)):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(
    pages: int, layers: int, reps: int, page_size: int, heads: int, head_dim: int, mode_extra: dict
):
    b = lf.build(
        "mha",
        extra=mode_extra,
        page_size=page_size,
        num_layers=layers,
        pages=pages * 2 + 2,
        head_num=heads,
        head_dim=head_dim,
    )
    try:
        first, total, offload = [], [], []
        nbytes = 0
        for rep in range(reps):
            toks = lf.tokens_for(1000 + rep, pages, page_size)
            slots = lf.alloc(b, len(toks))
            lf.fill_slots(b, slots, seed=rep)
            t0 = time.perf_counter()
            lf.insert(b, toks, slots)
            lf.wait_offloads(b)
            offload.append(time.perf_counter() - t0)
            want = lf.read_slots(b, slots)
            nbytes = sum(len(x) for x in want)
            lf.evict_all(b)
            lf.zero_all(b)
            r = lf.restore(b, f"bench{rep}", toks)
            assert r.failed == [] and r.loaded == len(toks), "load failed"
            assert lf.read_slots(b, r.indices) == want, "restore not byte-exact"
            first.append(r.first_layer_s)
            total.append(r.total_s)
            lf.evict_all(b)
        memcpy_total = _memcpy_s(nbytes, reps)
        return {
            "pages": pages,
            "layers": layers,
            "mib": nbytes / 2**20,
            "first_ms": statistics.median(first) * 1e3,
            "total_ms": statistics.median(total) * 1e3,
            "memcpy_layer_ms": memcpy_total / layers * 1e3,
            "memcpy_total_ms": memcpy_total * 1e3,
            "load_gib_s": nbytes / statistics.median(total) / 2**30,
            "offload_gib_s": nbytes / statistics.median(offload) / 2**30,
        }
    finally:
        b.close()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--pages", type=int, nargs="+", default=[16, 64])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--server-socket", default=None, help="a running kvtier serve (server mode)")
    args = ap.parse_args(argv)
    extra = {"dram_capacity_bytes": "2GiB", "dram_prefault": False}
    if args.server_socket:
        extra = {"server_socket": args.server_socket}
    print(
        f"MHA bf16, {args.page_size}-token pages, {args.heads} heads x {args.head_dim}, "
        f"{args.layers} layers; medians of {args.reps}"
    )
    print(
        "| pages | MiB | first layer ms | total ms | memcpy layer ms | memcpy total ms "
        "| load GiB/s | offload GiB/s |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for pages in args.pages:
        r = run(pages, args.layers, args.reps, args.page_size, args.heads, args.head_dim, extra)
        print(
            f"| {r['pages']} | {r['mib']:.0f} | {r['first_ms']:.2f} | {r['total_ms']:.2f} "
            f"| {r['memcpy_layer_ms']:.2f} | {r['memcpy_total_ms']:.2f} "
            f"| {r['load_gib_s']:.2f} | {r['offload_gib_s']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
