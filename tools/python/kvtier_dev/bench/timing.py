"""Timing helpers: nanosecond samples, robust statistics, interleaved repetitions."""

from __future__ import annotations

import gc
import math
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Sequence

now_ns = time.perf_counter_ns


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank-interpolated percentile (q in [0, 100]) of a non-empty sequence."""
    data = sorted(values)
    if not data:
        return float("nan")
    if len(data) == 1:
        return float(data[0])
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return float(data[lo] + (data[hi] - data[lo]) * (pos - lo))


@dataclass
class Samples:
    """Wall times (ns) of repetitions of one operation, plus what each moved."""

    bytes_per_rep: int = 0
    pages_per_rep: int = 0
    ns: List[int] = field(default_factory=list)
    failures: int = 0

    def add(self, ns: int, ok: bool = True) -> None:
        self.ns.append(int(ns))
        if not ok:
            self.failures += 1

    @property
    def reps(self) -> int:
        return len(self.ns)

    def summary(self) -> Dict[str, Any]:
        if not self.ns:
            return dict(reps=0, failures=self.failures)
        med = statistics.median(self.ns)
        out = dict(
            reps=self.reps,
            failures=self.failures,
            bytes_per_rep=self.bytes_per_rep,
            pages_per_rep=self.pages_per_rep,
            median_us=med / 1e3,
            p50_us=percentile(self.ns, 50) / 1e3,
            p99_us=percentile(self.ns, 99) / 1e3,
            min_us=min(self.ns) / 1e3,
            max_us=max(self.ns) / 1e3,
        )
        if self.bytes_per_rep and med > 0:
            out["gbps"] = self.bytes_per_rep / med  # bytes/ns == GB/s
        if self.pages_per_rep and med > 0:
            out["pages_per_s"] = self.pages_per_rep / (med / 1e9)
        return out


class gc_paused:
    """Disable the cyclic GC inside a timed region (and collect once before)."""

    def __enter__(self):
        self._was = gc.isenabled()
        gc.collect()
        gc.disable()
        return self

    def __exit__(self, *exc):
        if self._was:
            gc.enable()
        return False


@dataclass
class Runner:
    """One side of an interleaved measurement.

    ``setup(rep)`` runs untimed and returns the argument of ``timed``; ``timed(arg)`` is the
    measured call and returns True when every page it was asked for succeeded.
    """

    setup: Callable[[int], Any]
    timed: Callable[[Any], bool]
    samples: Samples
    warmup: int = 1
    min_reps: int = 3
    max_reps: int = 30
    budget_s: float = 2.0
    _spent_ns: int = 0
    _rep: int = 0

    def run_one(self, record: bool = True) -> None:
        started = now_ns()
        arg = self.setup(self._rep)
        self._rep += 1
        t0 = now_ns()
        ok = self.timed(arg)
        t1 = now_ns()
        if record:
            self.samples.add(t1 - t0, bool(ok))
        self._spent_ns += now_ns() - started

    def wants_more(self) -> bool:
        n = self.samples.reps
        if n < self.min_reps:
            return True
        return n < self.max_reps and self._spent_ns < self.budget_s * 1e9


def interleave(runners: Dict[str, Runner], rounds: int = 3) -> Dict[str, Samples]:
    """Run every runner's warm-up, then its repetitions in ``rounds`` alternating slices, so a
    slow phase of a noisy machine hits every side instead of one."""
    with gc_paused():
        for r in runners.values():
            for _ in range(r.warmup):
                r.run_one(record=False)
            r._spent_ns = 0
        for rnd in range(rounds):
            for r in runners.values():
                # Each slice gets an equal share of the remaining reps and budget.
                share_reps = max(1, math.ceil(r.max_reps / rounds))
                share_ns = r.budget_s * 1e9 * (rnd + 1) / rounds
                target_min = math.ceil(r.min_reps * (rnd + 1) / rounds)
                done = 0
                while (
                    r.wants_more()
                    and done < share_reps
                    and (r.samples.reps < target_min or r._spent_ns < share_ns)
                ):
                    r.run_one()
                    done += 1
            gc.collect()
        # Top up anyone still below its minimum (e.g. a very slow first slice).
        for r in runners.values():
            while r.samples.reps < r.min_reps:
                r.run_one()
    return {name: r.samples for name, r in runners.items()}
