"""Embedded-mode Prometheus metrics through the real SGLang adapter: ``metrics_addr`` in
extra_config starts a ``/metrics`` endpoint (port 0: a free port, reported in the stats), and
every scrape shows exactly what the v1 calls just did. A bad address or a port in use fails
construction with an error naming ``metrics_addr``."""

import socket
import urllib.error
import urllib.request
import uuid

import pytest
from kvtier_dev.harness.pools import (
    alloc_indices,
    build_mha_host_pool,
    fill_pages,
    make_storage_config,
    read_pages,
)
from kvtier.sglang import KvtierStore

DYNAMIC = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore"}


def extra(**kw):
    return {**DYNAMIC, "dram_capacity_bytes": "64MiB", "interface_v1": 1, **kw}


def scrape(addr):
    """``name{k="v",...}`` (labels sorted) -> value."""
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        series, value = line.rsplit(" ", 1)
        if "{" in series:
            name, labels = series.split("{", 1)
            series = name + "{" + ",".join(sorted(labels.rstrip("}").split(","))) + "}"
        out[series] = float(value)
    return out


def delta(before, after, key):
    assert key in after, f"{key} not scraped; have {sorted(k for k in after if k[:12] == key[:12])}"
    return after[key] - before.get(key, 0.0)


def test_embedded_metrics_count_v1_calls_through_the_adapter():
    tag = f"m{uuid.uuid4().hex[:8]}"
    host = build_mha_host_pool()
    store = KvtierStore(
        make_storage_config(extra_config=extra(metrics_addr="127.0.0.1:0", extra_backend_tag=tag)),
        {},
    )
    store.register_mem_pool_host(host)
    addr = store.get_stats()["metrics_addr"]
    assert addr.startswith("127.0.0.1:") and not addr.endswith(":0")
    store_label = f'store="{tag}"'

    m0 = scrape(addr)
    keys = [f"p{i}" for i in range(4)]
    idx = alloc_indices(host, 4)
    fill_pages(host, idx, 3)
    assert store.batch_set_v1(keys, idx) == [True] * 4
    m1 = scrape(addr)
    # MHA: a K and a V object per page.
    assert delta(m0, m1, f"kvtier_puts_total{{{store_label}}}") == 8
    assert m1[f'kvtier_objects{{{store_label},tier="dram"}}'] == 8
    stored = sum(len(p) for p in read_pages(host, idx))
    assert m1[f'kvtier_stored_bytes{{{store_label},tier="dram"}}'] == stored
    assert delta(m0, m1, f"kvtier_bytes_in_total{{{store_label}}}") == stored
    assert delta(m0, m1, 'kvtier_request_duration_seconds_count{op="put"}') == 1

    # Four stored pages and two unknown ones: hits and misses of the KV pool.
    asked = keys + ["nope0", "nope1"]
    idx6 = alloc_indices(host, 6)
    assert store.batch_get_v1(asked, idx6) == [True] * 4 + [False] * 2
    assert store.batch_exists(asked) == 4
    m2 = scrape(addr)
    assert delta(m1, m2, 'kvtier_pool_hits_total{op="get",pool="kv"}') == 4
    assert delta(m1, m2, 'kvtier_pool_misses_total{op="get",pool="kv"}') == 2
    assert delta(m1, m2, 'kvtier_pool_hits_total{op="exists",pool="kv"}') == 4
    assert delta(m1, m2, 'kvtier_pool_misses_total{op="exists",pool="kv"}') == 2
    assert delta(m1, m2, f'kvtier_hits_total{{{store_label},tier="dram"}}') == 8
    assert delta(m1, m2, f"kvtier_bytes_out_total{{{store_label}}}") == stored
    assert delta(m1, m2, 'kvtier_request_duration_seconds_count{op="get"}') == 1
    assert delta(m1, m2, 'kvtier_request_duration_seconds_count{op="exists"}') == 1

    # Other paths answer 404; the endpoint outlives the store.
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"http://{addr}/", timeout=10)
    assert err.value.code == 404
    store.close()
    assert f"kvtier_puts_total{{{store_label}}}" in scrape(addr)


@pytest.mark.parametrize("bad", ["99999", "127.0.0.1:70000", "somehost:9100", ""])
def test_bad_metrics_addr_names_the_key(bad):
    with pytest.raises(ValueError, match="metrics_addr"):
        KvtierStore(make_storage_config(extra_config=extra(metrics_addr=bad)), {})


def test_metrics_port_in_use_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        with pytest.raises(Exception, match=rf"metrics_addr 127\.0\.0\.1:{port}: cannot listen"):
            KvtierStore(
                make_storage_config(extra_config=extra(metrics_addr=f"127.0.0.1:{port}")), {}
            )


def test_a_bare_port_is_loopback_with_health_and_readiness():
    """Issue 26/27: ``metrics_addr = "0"`` (a port alone) listens on 127.0.0.1, and the
    embedded endpoint answers /healthz and /readyz (ready: the store is open)."""
    store = KvtierStore(make_storage_config(extra_config=extra(metrics_addr="0")), {})
    try:
        addr = store.get_stats()["metrics_addr"]
        assert addr.startswith("127.0.0.1:") and not addr.endswith(":0"), addr
        for path, body in (("/healthz", "ok"), ("/readyz", "ready")):
            with urllib.request.urlopen(f"http://{addr}{path}", timeout=10) as r:
                assert r.status == 200
                assert r.read().decode().strip() == body
    finally:
        store.close()
