"""Smoke test of ``python -m kvtier_dev.bench sglang``: its workload functions at a tiny size.

Checks the structure of the results and that every byte kvtier (and HiCacheFile) restored was
verified; makes no timing assertion.
"""

from __future__ import annotations

import json
import math

import pytest

from kvtier_dev.bench import report
from kvtier_dev.bench import sglang_workloads as bw
from kvtier_dev.bench.__main__ import main

SUMMARY_KEYS = {"reps", "failures", "median_us", "p50_us", "p99_us"}


@pytest.fixture(scope="module", autouse=True)
def runtime():
    bw.configure_runtime()


def _check_op(op: dict, sides=(bw.KVTIER, bw.FILE), throughput=True):
    for side in sides:
        s = op[side]
        assert SUMMARY_KEYS <= set(s), (side, s)
        assert s["reps"] >= 1 and s["failures"] == 0, (side, s)
        assert s["median_us"] > 0
        if throughput:
            assert s["gbps"] > 0 and s["pages_per_s"] > 0 and s["bytes_per_rep"] > 0


def test_mha_workload_tiny(tmp_path):
    r = bw.mha_workload(bw.TINY, 32 * 1024, storage_root=str(tmp_path), flows=True)
    assert r["kind"] == "mha" and r["object_bytes"] == 32 * 1024 and r["page_bytes"] == 64 * 1024
    assert r["batch_pages"] == bw.TINY.batch_pages
    ops = r["ops"]
    for name in ("set", "get", "flow_backup", "flow_prefetch"):
        _check_op(ops[name])
    _check_op(ops["set_repeat"])
    _check_op(ops["flow_query"], throughput=False)
    assert ops["set"][bw.MEMCPY]["gbps"] > 0
    # kvtier's put is put-if-absent: a repeated set copies nothing.
    assert ops["set_repeat"][bw.KVTIER]["dedup_skip_rate"] == 1.0
    assert ops["set_repeat"][bw.KVTIER]["copied_bytes"] == 0
    assert r["verified"][bw.KVTIER] == {"get": True, "prefetch": True}
    assert r["verified"][bw.FILE] == {"get": True, "prefetch": True}
    assert r["verified"]["bytes"] == r["batch_pages"] * r["page_bytes"]
    assert r["kvtier_stats"]["evictions_capacity"] == 0


def test_large_object_mha_workload_tiny(tmp_path):
    r = bw.mha_workload(bw.TINY, 256 * 1024, storage_root=str(tmp_path), flows=False)
    assert r["model"]["page_size"] == 64 and r["page_bytes"] == 512 * 1024
    assert "flow_backup" not in r["ops"]
    _check_op(r["ops"]["set"])
    _check_op(r["ops"]["get"])
    assert r["verified"][bw.KVTIER] == {"get": True}


def test_dsv4_workload_tiny(tmp_path):
    r = bw.dsv4_workload(bw.TINY, storage_root=str(tmp_path))
    assert r["kind"] == "dsv4" and r["model"]["anchor"] == "LogicalHostPool"
    assert len(r["pools"]) >= 4
    ops = r["ops"]
    for name in ("set", "get", "set_repeat", "flow_backup", "flow_prefetch"):
        _check_op(ops[name])
    for name in ("exists_v2_4pools", "exists_v2_all_pools", "flow_query"):
        _check_op(ops[name], throughput=False)
    assert ops["exists_v2_4pools"]["pools"] == 4
    assert ops["exists_v2_all_pools"]["pools"] == len(r["pools"]) >= 4
    ver = r["verified"]
    assert ver[bw.KVTIER] == {
        "get": True,
        "exists_v2_4pools": True,
        "exists_v2_all_pools": True,
        "prefetch": True,
    }
    assert ver[bw.FILE] == {"get": True, "prefetch": True}
    assert r["kvtier_stats"]["evictions_capacity"] == 0


def test_cli_tiny_json_and_markdown(tmp_path, capsys):
    out = tmp_path / "bench.json"
    rc = main(
        [
            "sglang",
            "--scale",
            "tiny",
            "--only",
            "mha-32KiB",
            "--json",
            str(out),
            "--markdown",
            "--storage-dir",
            str(tmp_path),
            "-q",
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "| workload |" in text and "| target |" in text and "targets:" in text
    data = json.loads(out.read_text())
    assert {"machine", "scale", "memcpy", "workloads", "targets", "elapsed_s"} <= set(data)
    assert data["machine"]["nproc"] >= 1 and data["machine"]["sglang"]
    assert data["memcpy"]["reference_gbps"] > 0
    assert [w["workload"] for w in data["workloads"]] == ["mha-32KiB"]
    for t in data["targets"]:
        assert t["verdict"] in ("PASS", "MISS") and not math.isnan(t["measured"])
    # every verdict is recomputed from the figures, never stored
    again = [v.as_dict() for v in report.evaluate_targets(data)]
    assert again == data["targets"]
