"""Machine description, targets, and the tables of ``python -m kvtier_dev.bench sglang``.

Nothing here is a figure: every number printed comes from the run's results dict, and every
PASS/MISS is computed from it.
"""

from __future__ import annotations

import os
import platform
import subprocess
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence

KVTIER = "kvtier"
FILE = "hicache_file"
MEMCPY = "memcpy_same_size"
KiB = 1 << 10

# --------------------------------------------------------------------------
# Machine and versions
# --------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _mem_total() -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _git_rev() -> Optional[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        rev = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        if rev.returncode != 0:
            return None
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        )
        return rev.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except Exception:
        return None


def machine_info() -> Dict[str, Any]:
    import numpy
    import torch

    try:
        import sglang

        sglang_version = getattr(sglang, "__version__", "unknown")
    except Exception:
        sglang_version = "not importable"
    try:
        from kvtier import _native

        kvtier_version = getattr(_native, "__version__", "unknown")
    except Exception:
        kvtier_version = "not importable"
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:
        affinity = os.cpu_count()
    return dict(
        nproc=affinity,
        cpu_count=os.cpu_count(),
        cpu_model=_cpu_model(),
        mem_total_bytes=_mem_total(),
        kernel=platform.release(),
        python=platform.python_version(),
        torch=torch.__version__,
        torch_threads=torch.get_num_threads(),
        numpy=numpy.__version__,
        sglang=sglang_version,
        kvtier=kvtier_version,
        kvtier_git=_git_rev(),
        loadavg_start=os.getloadavg(),
    )


# --------------------------------------------------------------------------
# Targets
# --------------------------------------------------------------------------


@dataclass
class Verdict:
    target: str
    where: str
    measured: float
    threshold: float
    higher_is_better: bool
    unit: str

    @property
    def passed(self) -> bool:
        if self.measured != self.measured:  # NaN
            return False
        if self.higher_is_better:
            return self.measured >= self.threshold
        return self.measured <= self.threshold

    def as_dict(self) -> Dict[str, Any]:
        return dict(
            target=self.target,
            where=self.where,
            measured=self.measured,
            threshold=self.threshold,
            unit=self.unit,
            verdict="PASS" if self.passed else "MISS",
        )


def _gbps(s: Optional[dict]) -> float:
    return float((s or {}).get("gbps", float("nan")))


def _p50(s: Optional[dict]) -> float:
    return float((s or {}).get("p50_us", float("nan")))


def _median(s: Optional[dict]) -> float:
    return float((s or {}).get("median_us", float("nan")))


def speedup(op: dict) -> float:
    """kvtier vs HiCacheFile: how many times faster (time ratio of the medians)."""
    kv, fb = op.get(KVTIER), op.get(FILE)
    if not kv or not fb:
        return float("nan")
    a, b = _median(kv), _median(fb)
    return b / a if a > 0 else float("nan")


def _size_class(obj_bytes) -> str:
    if isinstance(obj_bytes, (list, tuple)):
        return "mixed"
    if obj_bytes >= 256 * KiB:
        return "large"
    if obj_bytes < 128 * KiB:
        return "small"
    return "mid"


def evaluate_targets(results: Dict[str, Any]) -> List[Verdict]:
    memcpy = results["memcpy"]["reference_gbps"]
    out: List[Verdict] = []
    for w in results["workloads"]:
        name = w["workload"]
        ops = w["ops"]
        cls = _size_class(w["object_bytes"])
        for op_name in ("set", "get"):
            op = ops.get(op_name)
            if not op:
                continue
            if cls == "large":
                out.append(
                    Verdict(
                        f"{op_name} >=256 KiB objects >= 60% of memcpy",
                        f"{name} {op_name}",
                        _gbps(op.get(KVTIER)) / memcpy,
                        0.60,
                        True,
                        "x memcpy",
                    )
                )
            if op_name == "set":
                out.append(
                    Verdict("set >= 10x HiCacheFile", f"{name} set", speedup(op), 10.0, True, "x")
                )
            elif cls in ("large", "mixed"):
                label = "get >=256 KiB >= 1.2x HiCacheFile" + (
                    " (mixed sizes, mostly >=256 KiB bytes)" if cls == "mixed" else ""
                )
                out.append(Verdict(label, f"{name} get", speedup(op), 1.2, True, "x"))
            elif cls == "small":
                out.append(
                    Verdict(
                        "get <128 KiB >= 3x HiCacheFile", f"{name} get", speedup(op), 3.0, True, "x"
                    )
                )
        for op_name in ("exists_v2_4pools", "exists_v2_all_pools"):
            op = ops.get(op_name)
            if not op:
                continue
            pools = op.get("pools", "?")
            out.append(
                Verdict(
                    f"batch_exists_v2 128 pages x {pools} pools p50 <= 100 us",
                    f"{name} {op_name}",
                    _p50(op.get(KVTIER)),
                    100.0,
                    False,
                    "us",
                )
            )
            out.append(
                Verdict(
                    "batch_exists_v2 >= 10x HiCacheFile",
                    f"{name} {op_name}",
                    _p50(op.get(FILE)) / _p50(op.get(KVTIER)),
                    10.0,
                    True,
                    "x",
                )
            )
        for op_name in ("flow_backup", "flow_query", "flow_prefetch"):
            op = ops.get(op_name)
            if op:
                out.append(
                    Verdict(
                        f"{op_name.split('_')[1]} flow ahead of HiCacheFile",
                        f"{name} {op_name}",
                        speedup(op),
                        1.0,
                        True,
                        "x",
                    )
                )
    return out


# --------------------------------------------------------------------------
# Tables
# --------------------------------------------------------------------------


def render(headers: Sequence[str], rows: Sequence[Sequence[str]], markdown: bool) -> str:
    if markdown:
        lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
        lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
        return "\n".join(lines)
    widths = [
        max(len(str(h)), *(len(str(r[i])) for r in rows)) if rows else len(h)
        for i, h in enumerate(headers)
    ]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*headers), "  ".join("-" * w for w in widths)]
    lines += [fmt.format(*[str(c) for c in r]) for r in rows]
    return "\n".join(lines)


def _fmt_gbps(s: Optional[dict]) -> str:
    if not s or "gbps" not in s:
        return "-"
    return f"{s['gbps']:.2f} GB/s"


def _fmt_rate(s: Optional[dict]) -> str:
    if not s or "pages_per_s" not in s:
        return "-"
    v = s["pages_per_s"]
    return f"{v / 1e3:.1f}k pg/s" if v < 1e6 else f"{v / 1e6:.2f}M pg/s"


def _fmt_lat(s: Optional[dict]) -> str:
    if not s or "p50_us" not in s:
        return "-"
    return f"p50 {s['p50_us']:.1f} / p99 {s['p99_us']:.1f} us"


def _fmt_ms(s: Optional[dict]) -> str:
    if not s or "median_us" not in s:
        return "-"
    return f"{s['median_us'] / 1e3:.2f} ms"


def _fmt_x(v: float) -> str:
    return "-" if v != v else f"{v:.2f}x"


def _cell(op_name: str, s: Optional[dict]) -> str:
    if s is None:
        return "-"
    fail = f" [{s['failures']} FAILED]" if s.get("failures") else ""
    if op_name.startswith("exists") or op_name == "flow_query":
        return _fmt_lat(s) + fail
    if op_name.startswith("flow"):
        return f"{_fmt_ms(s)}, {_fmt_gbps(s)}" + fail
    return f"{_fmt_gbps(s)}, {_fmt_rate(s)}" + fail


OP_LABELS = {
    "set": "set (fresh keys)",
    "set_repeat": "set (all present)",
    "get": "get",
    "exists_v2_4pools": "batch_exists_v2 x4 pools",
    "exists_v2_all_pools": "batch_exists_v2 all pools",
    "flow_backup": "backup_span",
    "flow_query": "query_span",
    "flow_prefetch": "prefetch_span",
}


def _objects_label(w: dict) -> str:
    ob = w["object_bytes"]
    if isinstance(ob, (list, tuple)):
        return f"{len(ob)} pools, {min(ob) / KiB:.1f}-{max(ob) / KiB:.0f} KiB"
    return f"{ob // KiB} KiB x{w.get('objects_per_page', 1)}"


def results_table(results: Dict[str, Any], verdicts: List[Verdict], markdown: bool) -> str:
    memcpy = results["memcpy"]["reference_gbps"]
    by_where: Dict[str, List[Verdict]] = {}
    for v in verdicts:
        by_where.setdefault(v.where, []).append(v)
    headers = [
        "workload",
        "objects",
        "op",
        "kvtier",
        "HiCacheFile",
        "kvtier/File",
        "kvtier/memcpy",
        "memcpy@size",
        "targets",
    ]
    rows = []
    for w in results["workloads"]:
        for op_name, op in w["ops"].items():
            kv, fb = op.get(KVTIER), op.get(FILE)
            ratio_mem = "-"
            if kv and "gbps" in kv and op_name in ("set", "get", "flow_backup", "flow_prefetch"):
                ratio_mem = f"{kv['gbps'] / memcpy:.2f}"
            same = op.get(MEMCPY)
            same_cell = "-"
            if same and kv and "gbps" in same:
                same_cell = f"{same['gbps']:.2f} GB/s ({kv['gbps'] / same['gbps']:.2f})"
            extra = ""
            if op_name == "set_repeat" and kv and "dedup_skip_rate" in kv:
                extra = f", dedup skips {kv['dedup_skip_rate'] * 100:.0f}%"
            tcell = (
                "; ".join(
                    f"{_short(v)} {'PASS' if v.passed else 'MISS'}"
                    for v in by_where.get(f"{w['workload']} {op_name}", [])
                )
                or "-"
            )
            rows.append(
                [
                    w["workload"],
                    _objects_label(w),
                    OP_LABELS.get(op_name, op_name),
                    _cell(op_name, kv) + extra,
                    _cell(op_name, fb),
                    _fmt_x(speedup(op)),
                    ratio_mem,
                    same_cell,
                    tcell,
                ]
            )
    return render(headers, rows, markdown)


def _short(v: Verdict) -> str:
    if v.unit == "x memcpy":
        return ">=0.60 memcpy"
    if v.unit == "us":
        return "p50<=100us"
    return f">={v.threshold:g}x File" if "HiCacheFile" in v.target else f">={v.threshold:g}x"


def targets_table(verdicts: List[Verdict], markdown: bool) -> str:
    headers = ["target", "where", "measured", "threshold", "verdict"]
    rows = []
    for v in verdicts:
        unit = v.unit
        measured = f"{v.measured:.2f} {unit}" if unit != "us" else f"{v.measured:.1f} us"
        threshold = ("<= " if not v.higher_is_better else ">= ") + (f"{v.threshold:g} {unit}")
        rows.append([v.target, v.where, measured, threshold, "PASS" if v.passed else "MISS"])
    return render(headers, rows, markdown)


def verification_lines(results: Dict[str, Any]) -> List[str]:
    lines = []
    for w in results["workloads"]:
        ver = w.get("verified", {})
        parts = []
        for side in (KVTIER, FILE):
            checks = ver.get(side, {})
            if checks:
                bad = [k for k, ok in checks.items() if not ok]
                parts.append(
                    f"{side}: "
                    + ("all bytes verified" if not bad else "FAILED " + ", ".join(bad))
                    + f" ({', '.join(checks)})"
                )
        lines.append(f"  {w['workload']}: " + "; ".join(parts))
    return lines


def header_lines(results: Dict[str, Any]) -> List[str]:
    m = results["machine"]
    mem = results["memcpy"]
    lines = [
        f"machine: nproc={m['nproc']} cpu='{m['cpu_model']}' mem={m['mem_total_bytes'] and m['mem_total_bytes'] / 2**30:.1f} GiB "
        f"kernel={m['kernel']} load(start)={'/'.join(f'{x:.2f}' for x in m['loadavg_start'])} "
        f"load(end)={'/'.join(f'{x:.2f}' for x in m.get('loadavg_end', ()))}",
        f"versions: kvtier {m['kvtier']} ({m['kvtier_git']}), sglang {m['sglang']}, torch {m['torch']} "
        f"(threads {m['torch_threads']}), numpy {m['numpy']}, python {m['python']}",
        f"scale: {results['scale']['name']} ({results['elapsed_s']:.0f} s), batch {results['scale']['batch_pages']} pages, "
        f"medians over interleaved reps",
        "memcpy (1 thread, best of np.copyto / libc memmove of 2 MiB blocks over a cold {:.0f} MiB src/dst): best {:.2f} GB/s at start, "
        "{:.2f} GB/s at end -> reference {:.2f} GB/s".format(
            mem["start"]["total_bytes"] / 2**20,
            mem["start"]["best_gbps"],
            mem["end"]["best_gbps"],
            mem["reference_gbps"],
        ),
        "memcpy at object size (np.take of random objects, best): "
        + ", ".join(
            f"{int(k) // KiB if int(k) >= KiB else int(k)}{'KiB' if int(k) >= KiB else 'B'} {v['best_gbps']:.2f}"
            for k, v in sorted(mem["objects"].items(), key=lambda kv: int(kv[0]))
        )
        + " GB/s",
    ]
    return lines
