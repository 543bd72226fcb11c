"""The demote hint: after a backup continues a chain, the adapter tells the store that the
window state (SWA, C4 state, C4 indexer state: SGLang's TRAILING_PAGES pools) of the chain's
previous end is superseded, and the prefix_depth policy drops exactly that state before any
whole page.

Real SGLang 0.5.23 DeepSeek-V4 HostPoolGroup on CPU, kvtier built by SGLang's dynamic
factory, SGLang's own controller methods for the existence query, prefetch and backup
(``kvtier_dev.harness.flows``). Every restored page is compared byte for byte with what was
written for its hash.
"""

from __future__ import annotations

import pytest
from sglang.srt.mem_cache.hicache_storage import PoolName

from kvtier_dev.bench import workload as wl
from kvtier_dev.harness.pools import page_nbytes

MIB = 1 << 20


@pytest.fixture(scope="module")
def dsv4():
    return wl.build_pools()


def _chain(label: str, pages: int) -> list:
    h, out = "root", []
    for i in range(pages):
        h = wl._chain(h, f"{label}.{i}")
        out.append(h)
    return out


def _bytes_after(dsv4, spans) -> int:
    """DRAM bytes in use after serving ``spans`` on an unbounded store."""
    backend, cfg = wl.open_backend(dsv4, "prefix_depth", 256)
    try:
        r = wl.RunResult("probe", 256)
        for span in spans:
            wl.serve_request(backend, cfg, dsv4, span, r)
        return int(backend._store.stats()["bytes_allocated"])
    finally:
        backend.close()


def _replay(dsv4, policy, budget_bytes, spans):
    backend, cfg = wl.open_backend(dsv4, policy, budget_bytes / MIB)
    r = wl.RunResult(policy, budget_bytes / MIB)
    hits = [wl.serve_request(backend, cfg, dsv4, span, r) for span in spans]
    return backend, cfg, r, hits


def test_superseded_window_state_goes_before_any_page(dsv4):
    a = _chain("a", 6)
    b = _chain("b", 6)
    # Turn 1 of conversation a, turn 2 continues it (restores 4 pages, backs up 2), then an
    # unrelated conversation b arrives.
    spans = [a[:4], a, b]
    before_b = _bytes_after(dsv4, spans[:2])
    everything = _bytes_after(dsv4, spans)
    # Room for all but ~half of one page's window state: something must go for b to fit.
    swa_bytes = sum(
        page_nbytes(s.host_pool)
        for s in dsv4.side_specs
        if s.name == PoolName.SWA or s.indices_from_pool == PoolName.SWA
    )
    budget = everything - swa_bytes // 2
    assert before_b < budget < everything

    backend, cfg, r, hits = _replay(dsv4, "prefix_depth", budget, spans)
    try:
        assert hits == [0, 4, 0]
        stats = backend._store.stats()
        # Only superseded state was dropped: no whole page went.
        assert stats["evictions_superseded"] > 0
        assert stats["evictions_capacity"] == 0
        assert r.wrong_pages == 0
        probe = wl.RunResult("probe", 0)
        # Both current conversation ends are restorable, byte-exact...
        assert wl.serve_request(backend, cfg, dsv4, a, probe) == len(a)
        assert wl.serve_request(backend, cfg, dsv4, b, probe) == len(b)
        assert probe.wrong_pages == 0
        # ... and the old end a[:4] lost its window state, not its pages: as the inside of
        # the longer chain it still restores a (above), alone it restores nothing.
        assert wl.serve_request(backend, cfg, dsv4, a[:4], probe) == 0
    finally:
        backend.close()

    # Plain LRU ignores the hint: it evicts the coldest whole page, the head of a.
    backend, cfg, r, hits = _replay(dsv4, "lru", budget, spans)
    try:
        stats = backend._store.stats()
        assert stats["evictions_superseded"] == 0
        assert stats["evictions_capacity"] > 0
        probe = wl.RunResult("probe", 0)
        assert wl.serve_request(backend, cfg, dsv4, a, probe) < len(a)
    finally:
        backend.close()


def test_demoted_state_stays_until_room_is_needed(dsv4):
    # The hint only reorders eviction: with room to spare nothing is dropped and the old
    # chain end stays restorable next to the new one.
    a = _chain("c", 5)
    backend, cfg, r, hits = _replay(dsv4, "prefix_depth", 64 * MIB, [a[:3], a])
    try:
        assert hits == [0, 3]
        stats = backend._store.stats()
        assert stats["evictions_superseded"] == 0 and stats["evictions_capacity"] == 0
        probe = wl.RunResult("probe", 0)
        assert wl.serve_request(backend, cfg, dsv4, a[:3], probe) == 3
        assert wl.serve_request(backend, cfg, dsv4, a, probe) == 5
        assert probe.wrong_pages == 0
    finally:
        backend.close()
