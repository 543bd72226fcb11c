"""``python -m kvtier_dev.bench workload``: one quick run through the real SGLang backend.

Checks the trace generator, the report's structure, that every restored page was verified
against the bytes written for it, and that both policies ran on the same trace; a budget
larger than the working set must evict nothing and give both policies the same figures.
Makes no timing assertion and does not assert which policy wins (that is the benchmark's
finding, reported in docs/, not a property of a tiny trace).
"""

from __future__ import annotations

import json

import pytest

from kvtier_dev.bench import workload as wl
from kvtier_dev.bench.__main__ import main

SMALL, LARGE = 6.0, 64.0  # MiB: below and above the quick trace's ~16 MiB working set


def test_trace_is_deterministic_and_conversations_grow():
    shape = wl.QUICK_SHAPE
    a, b = wl.make_trace(shape), wl.make_trace(shape)
    assert [(r.user, r.pages, r.tail_tokens) for r in a] == [
        (r.user, r.pages, r.tail_tokens) for r in b
    ]
    assert len(a) == shape.users * shape.turns
    last = {}
    for r in a:
        assert 0 <= r.tail_tokens < shape.page_size
        prev = last.get(r.user)
        if prev is None:
            assert len(r.pages) >= shape.system_pages + 1
        else:
            # The whole earlier conversation is the prefix of the next turn, plus 1..turn_pages.
            assert r.pages[: len(prev)] == prev
            assert 1 <= len(r.pages) - len(prev) <= shape.turn_pages
        last[r.user] = r.pages
    other = wl.make_trace(wl.TraceShape(**{**wl.asdict(shape), "seed": 1}))
    assert [r.pages for r in other] != [r.pages for r in a]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    d = tmp_path_factory.mktemp("workload")
    js, png = d / "w.json", d / "w.png"
    rc = main(
        [
            "workload",
            "--quick",
            "--budgets",
            f"{SMALL:g},{LARGE:g}",
            "--json",
            str(js),
            "--png",
            str(png),
            "-q",
        ]
    )
    assert rc == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return json.loads(js.read_text())


def test_report_structure_and_both_policies(report):
    assert report["policies"] == ["prefix_depth", "lru"]
    assert report["budgets_mib"] == [SMALL, LARGE]
    trace = wl.make_trace(wl.QUICK_SHAPE)
    assert report["requests"] == len(trace)
    assert report["distinct_pages"] == len({h for r in trace for h in r.pages})
    assert SMALL * wl.MIB < report["working_set_bytes"] < LARGE * wl.MIB
    runs = {(r["policy"], r["dram_mib"]): r for r in report["results"]}
    assert set(runs) == {(p, b) for p in ("prefix_depth", "lru") for b in (SMALL, LARGE)}
    for r in runs.values():
        assert r["requests"] == report["requests"]
        assert r["prompt_tokens"] == report["prompt_tokens"]
        assert 0 < r["hit_tokens"] < r["prompt_tokens"]
        assert r["token_hit_rate"] == pytest.approx(r["hit_tokens"] / r["prompt_tokens"])
        assert r["pages_hit"] + r["pages_backed_up"] == r["pages_asked"]
        assert r["stats"]["capacity_bytes"] == int(r["dram_mib"] * wl.MIB)


def test_every_restored_page_was_verified(report):
    for r in report["results"]:
        assert r["wrong_pages"] == 0
        # Hits were loaded and compared byte for byte: some bytes per restored page.
        assert r["pages_hit"] > 0 and r["bytes_loaded"] > 0
        assert r["bytes_stored"] > 0


def test_small_budget_evicts_whole_pages_large_budget_evicts_nothing(report):
    runs = {(r["policy"], r["dram_mib"]): r for r in report["results"]}
    for p in ("prefix_depth", "lru"):
        small, large = runs[(p, SMALL)], runs[(p, LARGE)]
        assert small["evicted_objects"] > 0 and small["evicted_groups"] > 0
        # A DeepSeek-V4 page is several objects, evicted together.
        assert small["evicted_objects"] > small["evicted_groups"]
        assert large["evicted_objects"] == 0 and large["evicted_groups"] == 0
        assert large["hit_tokens"] > small["hit_tokens"]
    # Nothing evicted: the policy cannot matter.
    a, b = runs[("prefix_depth", LARGE)], runs[("lru", LARGE)]
    for k in ("hit_tokens", "pages_hit", "bytes_loaded", "bytes_stored"):
        assert a[k] == b[k], k


@pytest.mark.parametrize(
    "argv",
    [["--budgets", "x"], ["--budgets", "0"], ["--window", "0"]],
)
def test_bad_arguments_exit_2(argv, capsys):
    assert main(["workload", "--quick", "-q", *argv]) == 2
    assert capsys.readouterr().err.startswith(("--budgets", "--window"))
