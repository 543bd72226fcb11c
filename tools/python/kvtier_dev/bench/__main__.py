"""``python -m kvtier_dev.bench sglang|profile|workload [--quick] [--json PATH] ...``."""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvtier_dev.bench", description=__doc__)
    sub = p.add_subparsers(dest="suite", required=True)
    s = sub.add_parser(
        "sglang",
        help="kvtier vs SGLang HiCacheFile on real SGLang host pools and controller flows, vs memcpy",
        description="Measures memcpy, then MHA page_first (32 KiB .. 2 MiB objects) and DeepSeek-V4 "
        "HostPoolGroup workloads through kvtier (embedded) and HiCacheFile: raw 128-page "
        "set/get/batch_exists_v2 calls and SGLang's backup/query/prefetch flows.",
    )
    mode = s.add_mutually_exclusive_group()
    mode.add_argument(
        "--quick", action="store_true", help="~1 minute: fewer sizes, smaller pools, fewer reps"
    )
    mode.add_argument("--scale", choices=("full", "quick", "tiny"), help=argparse.SUPPRESS)
    s.add_argument(
        "--json",
        metavar="PATH",
        help="write every figure (and the machine, versions, targets) as JSON",
    )
    s.add_argument("--markdown", action="store_true", help="print README-ready markdown tables")
    s.add_argument(
        "--storage-dir",
        metavar="DIR",
        default=None,
        help="parent of HiCacheFile's temporary storage directory (default: the system temp dir)",
    )
    s.add_argument(
        "--only",
        metavar="NAME",
        action="append",
        help="run only workloads whose name contains NAME (repeatable): mha-32KiB, mha-2MiB, dsv4 ...",
    )
    s.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    pr = sub.add_parser(
        "profile", help="split kvtier's call time into native copy, SGLang metadata and adapter"
    )
    pr.add_argument("--quick", action="store_true")
    pr.add_argument("--json", metavar="PATH")
    from kvtier_dev.bench import workload

    w = sub.add_parser(
        "workload",
        help="multi-turn chat trace through the SGLang backend: prefix_depth vs lru eviction "
        "over several DRAM budgets (token hit rate, restorable prefix, bytes moved)",
        description=workload.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    workload.add_arguments(w)
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.suite == "workload":
        from kvtier_dev.bench import workload

        return workload.main(args)
    if args.suite == "profile":
        from kvtier_dev.bench import profile

        r = profile.run(quick=args.quick)
        print(profile.format_report(r))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(r, f, indent=1, default=str)
        return 0
    from kvtier_dev.bench import report
    from kvtier_dev.bench.sglang_workloads import SCALES, run_all

    scale = SCALES[args.scale or ("quick" if args.quick else "full")]

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[kvtier_dev.bench] {msg}", file=sys.stderr, flush=True)

    results = run_all(scale, storage_root=args.storage_dir, only=args.only, progress=progress)
    verdicts = report.evaluate_targets(results)
    md = args.markdown
    out = []
    out += report.header_lines(results)
    out.append("")
    out.append(report.results_table(results, verdicts, md))
    out.append("")
    out.append(report.targets_table(verdicts, md))
    passed = sum(v.passed for v in verdicts)
    out.append("")
    out.append(f"targets: {passed}/{len(verdicts)} PASS")
    out.append("verification (outside the timed region, byte for byte):")
    out += report.verification_lines(results)
    print("\n".join(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
        progress(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
