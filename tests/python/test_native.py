"""The native module kvtier._native on its own: strict configuration, region checks, exact
sizes, buffer-protocol copies, and that batch calls release the GIL."""

import json
import threading
import time

import numpy as np
import pytest

from kvtier import _native


def store(**cfg):
    cfg.setdefault("dram_capacity_bytes", "64MiB")
    return _native.Store(json.dumps(cfg), False)


def registered(s, nbytes, fill=0):
    buf = np.full(nbytes, fill, dtype=np.uint8)
    s.register_region(buf.ctypes.data, buf.nbytes, "test")
    return buf


def test_check_config_prints_the_effective_config_and_names_bad_keys():
    toml = _native.Store.check_config(json.dumps({"dram_capacity_bytes": "8MiB"}), False)
    assert "dram_capacity_bytes = 8388608" in toml
    with pytest.raises(ValueError, match="dram_block_size"):
        _native.Store.check_config(json.dumps({"dram_block_size": 3000}), False)
    with pytest.raises(ValueError, match="JSON object"):
        _native.Store("[1, 2]", False)
    assert "eviction_policy" in _native.Store.known_config_keys()


def test_put_get_through_registered_memory_with_exact_sizes():
    s = store()
    buf = registered(s, 1 << 20)
    buf[:4096] = np.arange(4096) % 251
    base = buf.ctypes.data
    ok, errors = s.put_keys(["a", "b"], [base, base + 100], [4096, 333], None)
    assert ok == [True, True] and errors == []
    ok, errors = s.get_keys(["a"], [base + 8192], [4096])
    assert ok == [True]
    assert np.array_equal(buf[8192 : 8192 + 4096], buf[:4096])
    # Wrong size: a failure naming the mismatch, and the destination untouched.
    buf[65536 : 65536 + 5000] = 9
    ok, errors = s.get_keys(["a"], [base + 65536], [5000])
    assert ok == [False] and "size" in errors[0]
    assert np.all(buf[65536 : 65536 + 5000] == 9)
    assert s.object_len("b") == 333


def test_pointers_outside_registered_memory_are_refused_and_touch_nothing():
    s = store()
    buf = registered(s, 8192)
    other = np.full(4096, 5, dtype=np.uint8)  # not registered
    ok, errors = s.put_keys(["x"], [other.ctypes.data], [4096], None)
    assert ok == [False] and "outside every registered memory region" in errors[0]
    ok, errors = s.put_keys(["y"], [buf.ctypes.data + 8000], [500], None)  # runs past the end
    assert ok == [False]
    assert s.put_keys(["z"], [buf.ctypes.data], [4096], None)[0] == [True]
    ok, _ = s.get_keys(["z"], [other.ctypes.data], [4096])
    assert ok == [False] and np.all(other == 5)
    stats = s.stats()
    assert stats["rejected_buffers"] == 3 and stats["objects"] == 1


def test_malformed_batches_fail_whole_and_store_nothing():
    s = store()
    buf = registered(s, 4096)
    ok, errors = s.put_pages("", ["p0", "p1"], [".k", ".v"], [buf.ctypes.data] * 3, [16] * 3, None)
    assert ok == [False, False] and "3 buffers for 2 pages x 2 components" in errors[0]
    ok, errors = s.put_keys(["a"], [buf.ctypes.data], [1, 2], None)
    assert ok == [False] and "pointers" in errors[0]
    ok, errors = s.put_pages("", ["p0"], [".k"], [buf.ctypes.data], [16], [1, 2])
    assert ok == [False] and "depths" in errors[0]
    assert s.stats()["objects"] == 0
    with pytest.raises(ValueError, match="hit policy"):
        s.exists_v2("", ["p0"], None, [("swa", [".swa"], "most_pages", 0)])


def test_a_failed_component_rolls_back_the_page():
    s = store()
    buf = registered(s, 8192)
    outside = np.zeros(64, dtype=np.uint8)
    ok, _ = s.put_pages(
        "", ["p"], [".k", ".v"], [buf.ctypes.data, outside.ctypes.data], [64, 64], None
    )
    assert ok == [False]
    assert s.exists_keys(["p.k", "p.v"]) == [False, False]


def test_buffer_protocol_copies():
    s = store()
    src = np.arange(1000, dtype=np.uint8)
    ok, _ = s.put_buffers(["k"], [src], None)
    assert ok == [True]
    dst = np.zeros(1000, dtype=np.uint8)
    assert s.get_buffers(["k"], [dst])[0] == [True]
    assert np.array_equal(src, dst)
    with pytest.raises(ValueError, match="read-only"):
        s.get_buffers(["k"], [bytes(1000)])
    with pytest.raises(ValueError, match="contiguous"):
        s.put_buffers(["k2"], [np.zeros((10, 10), dtype=np.uint8)[:, 0]], None)


def test_clear_remove_and_close():
    s = store()
    src = np.ones(10, dtype=np.uint8)
    s.put_buffers(["a", "b"], [src, src], None)
    assert s.remove_keys(["a", "nope"]) == 1
    assert s.exists_keys(["a", "b"]) == [False, True]
    s.clear()
    assert s.exists_keys(["b"]) == [False]
    s.close()
    assert s.closed
    ok, errors = s.put_buffers(["c"], [src], None)
    assert ok == [False] and "closed" in errors[0]


def test_batch_calls_release_the_gil():
    s = store(dram_capacity_bytes="512MiB")
    n, size = 48, 4 << 20
    buf = registered(s, n * size, fill=3)
    ptrs = [buf.ctypes.data + i * size for i in range(n)]
    stamps = []
    stop = threading.Event()

    def python_work():
        while not stop.is_set():
            stamps.append(time.perf_counter())

    t = threading.Thread(target=python_work)
    t.start()
    try:
        windows = []
        for rep in range(3):
            start = time.perf_counter()
            ok, _ = s.put_keys([f"r{rep}.{i}" for i in range(n)], ptrs, [size] * n, None)
            end = time.perf_counter()
            assert all(ok)
            windows.append((start, end))
    finally:
        stop.set()
        t.join()
    # While the native call copies 192 MiB, the other Python thread keeps running.
    inside = sum(1 for ts in stamps for a, b in windows if a + 0.002 < ts < b - 0.002)
    assert inside > 0, f"no Python progress during the native calls: {windows}"
