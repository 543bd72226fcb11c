"""Issue 27: Rust records reach Python's ``logging`` under the ``kvtier`` logger.

A real embedded ``Store`` opens an SSD directory with a corrupted record (and no checkpoint,
so the open scans the segment): the engine's warning lands in ``logging`` as a record of
``kvtier.engine.ssd.tier.recovery`` (WARNING, with its fields), so an engine's own log (SGLang,
vLLM, LMCache) shows it. Raising the ``kvtier`` logger's level filters it at the source;
records logged from Rust threads that never held the GIL arrive too, and the module counts
the records it had to drop.
"""

import json
import logging
import os
import threading

import kvtier._native as native
from kvtier import Store

DAMAGED = "dropped damaged SSD records"


def ssd_config(path):
    return json.dumps(
        {
            "dram_capacity_bytes": "1MiB",
            "dram_prefault": False,
            "ssd_enabled": True,
            "ssd_storage_dir": str(path),
            "ssd_segment_size_bytes": "1MiB",
            "ssd_capacity_bytes": "4MiB",
            "ssd_durability_mode": "strict",
        }
    )


def damaged_dir(path):
    """Ten objects on SSD, the second one's payload damaged, no index checkpoint."""
    store = Store(ssd_config(path), False)
    keys = [f"k{i}" for i in range(10)]
    ok, errors = store.put_buffers(keys, [bytearray([i]) * 10_000 for i in range(10)])
    assert ok == [True] * 10, errors
    store.close()
    seg = path / "seg-000000.kvt"
    data = bytearray(seg.read_bytes())
    data[4096 * 4 + 100] ^= 1
    seg.write_bytes(bytes(data))
    os.remove(path / "index.ckpt")


def test_corrupt_record_warning_reaches_python_logging(tmp_path, caplog):
    damaged_dir(tmp_path / "ssd")
    caplog.set_level(logging.WARNING, logger="kvtier")
    store = Store(ssd_config(tmp_path / "ssd"), False)
    assert native.flush_logs(5.0)
    records = [r for r in caplog.records if DAMAGED in r.getMessage()]
    assert records, [r.getMessage() for r in caplog.records]
    r = records[0]
    assert r.name == "kvtier.engine.ssd.tier.recovery"
    assert r.levelno == logging.WARNING
    assert "corrupt=1" in r.getMessage()
    assert r.rust_target == "kvtier_engine::ssd::tier::recovery"
    assert r.pathname.endswith("recovery.rs") and r.lineno > 0
    # The object itself is gone (a miss), the other nine are served.
    assert sum(store.exists_keys([f"k{i}" for i in range(10)])) == 9
    store.close()


def test_the_kvtier_logger_level_filters_at_the_source(tmp_path, caplog):
    damaged_dir(tmp_path / "ssd")
    caplog.set_level(logging.ERROR, logger="kvtier")
    store = Store(ssd_config(tmp_path / "ssd"), False)
    assert native.flush_logs(5.0)
    assert not [r for r in caplog.records if DAMAGED in r.getMessage()]
    store.close()


def test_records_from_rust_threads_arrive_and_nothing_deadlocks(tmp_path, caplog):
    """Stores opened on Python threads that released the GIL for the open, while the main
    thread holds the GIL in a handler: every warning arrives, none is dropped."""
    caplog.set_level(logging.WARNING, logger="kvtier")
    dirs = [tmp_path / f"ssd{i}" for i in range(4)]
    for d in dirs:
        damaged_dir(d)
    dropped_before = native.log_records_dropped()

    def open_and_close(d):
        Store(ssd_config(d), False).close()

    threads = [threading.Thread(target=open_and_close, args=(d,)) for d in dirs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    assert native.flush_logs(5.0)
    assert len([r for r in caplog.records if DAMAGED in r.getMessage()]) == 4
    assert native.log_records_dropped() == dropped_before
