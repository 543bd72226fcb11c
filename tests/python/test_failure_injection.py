"""kvtier under SGLang's own failure injector.

The backend is built by the real ``StorageBackendFactory.create_backend("dynamic", ...)``
with ``SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE`` (and ``..._RANDOM_DELAY``) set, so every
storage call goes through SGLang's ``HiCacheStorageFailureInjector`` first.  Then many rounds
of backup -> query -> prefetch run through the real controller flows with random spans
(conversations that extend earlier ones, partial and multi-batch spans).

Every round, whatever the flow reports as restored must be byte-exact; failures may only
shorten hits (never beyond what the store really holds); and after all rounds a clean run
(injector off: the inner KvtierStore itself) restores everything byte-exact.

Page content is a pure function of (pool, page hash), so a retried backup of a page writes
the same bytes and "the truth" of every page is known whatever the failure pattern was.
Pages are written and read straight through the pool's own ``get_page_buffer_meta``
pointers (the memory a zero-copy backend and ``set_from_flat_data_page`` both touch): the
flat-page helpers allocate a fresh dummy page per call, too slow for 40 rounds of DSV4.
The injector draws from its own thread-local Random; Python's ``random`` is seeded for the
spans only, and the assertions hold for any failure pattern.
"""

from __future__ import annotations

import ctypes
import random
import zlib

import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector, PoolName

import kvtier_dev.harness.flows as cf
import kvtier_dev.harness.pools as sp
from kvtier.sglang import KvtierStore

DYNAMIC = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore"}
ROUNDS = 40


def _page_meta(pool, start):
    ptrs, sizes = pool.get_page_buffer_meta(
        torch.arange(start, start + pool.page_size, dtype=torch.int64)
    )
    return list(zip(ptrs, sizes))


def write_page(pool, start, comps):
    for (ptr, size), data in zip(_page_meta(pool, start), comps, strict=True):
        assert len(data) == size
        ctypes.memmove(ptr, data, size)


def read_page(pool, start):
    return [ctypes.string_at(ptr, size) for ptr, size in _page_meta(pool, start)]


def zero_page(pool, start):
    for ptr, size in _page_meta(pool, start):
        ctypes.memset(ptr, 0, size)


class Rig:
    def __init__(self, kind, use_v1):
        self.use_v1 = use_v1
        if kind == "dsv4":
            self.stack = sp.build_dsv4_pool_group("page_first", device_full_pages=24)
            self.target = self.stack
            self.specs = self.stack.specs
            self.anchor = self.stack.anchor
            self.max_span = 20
            is_mla = True
        else:
            self.stack = None
            self.anchor = sp.build_mha_host_pool("page_first", size_pages=300)
            self.target = self.anchor
            self.specs = cf.as_group_and_specs(self.anchor)[1]
            self.max_span = 140
            is_mla = False
        self.logical = self.anchor.kv_buffer is None
        ec = {**DYNAMIC, "dram_capacity_bytes": "128MiB"}
        if use_v1:
            ec["interface_v1"] = 1
        self.cfg = sp.make_storage_config(is_mla=is_mla, extra_config=ec)
        self.truth = {s.name: {} for s in self.specs}
        self.chains = []  # every conversation seen: (keys, node ends)
        self.restored_pages = 0
        self.short_rounds = 0

    def pool(self, name):
        return self.anchor if self.stack is None else self.stack.group.entry_map[name].host_pool

    def _on_swa(self, spec):
        return spec.name == PoolName.SWA or spec.indices_from_pool == PoolName.SWA

    def _content(self, spec, key):
        truth = self.truth[spec.name]
        if key not in truth:
            rng = random.Random(zlib.crc32(f"{spec.name.value}/{key}".encode()))
            truth[key] = [rng.randbytes(size) for _, size in _page_meta(spec.host_pool, 0)]
        return truth[key]

    def _fill(self, spec, idx, keys):
        for start, k in zip(sp.page_starts(spec.host_pool, idx), keys, strict=True):
            write_page(spec.host_pool, start, self._content(spec, k))

    def backup(self, backend, keys, before):
        n = len(keys)
        kv_idx = sp.alloc_indices(self.anchor, n)
        per_pool = {PoolName.KV: kv_idx}
        swa_idx = None
        if self.stack is not None:
            swa_idx = sp.alloc_indices(self.stack.spec(PoolName.SWA).host_pool, 1)
            per_pool[PoolName.SWA] = swa_idx
        for s in self.specs:
            if s.is_anchor and self.logical:
                continue
            if self._on_swa(s):
                self._fill(s, swa_idx, keys[-1:])
            else:
                self._fill(s, kv_idx, keys)
        res = cf.backup_span(
            backend, self.target, keys, per_pool, prefix_keys=list(before), use_v1=self.use_v1
        )
        sp.free_indices(self.anchor, kv_idx)
        if swa_idx is not None:
            sp.free_indices(self.stack.spec(PoolName.SWA).host_pool, swa_idx)
        return res

    def clean_hit(self, inner, span):
        return cf.query_span(
            inner, span, self.target if self.stack is None else self.stack
        ).kv_hit_pages

    def prefetch(self, backend, span):
        kv_idx = sp.alloc_indices(self.anchor, len(span))
        per_pool = {PoolName.KV: kv_idx}
        swa_idx = None
        if self.stack is not None:
            swa_idx = sp.alloc_indices(self.stack.spec(PoolName.SWA).host_pool, 1)
            per_pool[PoolName.SWA] = swa_idx
        for s in self.specs:
            if not (s.is_anchor and self.logical):
                for start in sp.page_starts(s.host_pool, swa_idx if self._on_swa(s) else kv_idx):
                    zero_page(s.host_pool, start)
        try:
            res = cf.prefetch_span(
                backend,
                self.target,
                span,
                prefix_keys=[],
                use_v1=self.use_v1,
                host_indices_per_pool=per_pool,
            )
            self.check_restored(res)
        finally:
            sp.free_indices(self.anchor, kv_idx)
            if swa_idx is not None:
                sp.free_indices(self.stack.spec(PoolName.SWA).host_pool, swa_idx)
        return res

    def check_restored(self, res):
        assert 0 <= res.kv_pages <= res.hit_pages
        for name, n in res.counts.items():
            spec = next(s for s in self.specs if s.name == name)
            assert 0 <= n <= res.hit_pages, name
            if n == 0 or (spec.is_anchor and self.logical):
                continue
            idx = res.host_indices[name][: n * spec.page_size]
            keys = res.key_ranges[name][:n]
            assert len(keys) == n
            for k, start in zip(keys, sp.page_starts(spec.host_pool, idx), strict=True):
                assert read_page(spec.host_pool, start) == self.truth[name][k], (
                    f"{name} page {k} restored with wrong bytes"
                )
            self.restored_pages += n

    def random_chain(self, rng):
        """A new conversation: fresh, or an earlier one's prefix plus new pages; returns
        (keys, number of leading pages shared with earlier conversations)."""
        length = (
            rng.choice([1, 2, 3, 5, 8, 13, 20])
            if rng.random() < 0.9 or self.stack
            else rng.randint(129, self.max_span)
        )
        length = min(length, self.max_span)
        tag = f"c{len(self.chains)}"
        if self.chains and rng.random() < 0.5:
            base = rng.choice(self.chains)
            shared = rng.randint(1, len(base))
            own = max(1, min(length, self.max_span - shared))
            keys = base[:shared] + [f"{tag}/{i}" for i in range(own)]
        else:
            shared = 0
            keys = [f"{tag}/{i}" for i in range(length)]
        self.chains.append(keys)
        return keys, shared


def run_rounds(rig, injector, inner, seed):
    rng = random.Random(seed)
    for r in range(ROUNDS):
        keys, shared = rig.random_chain(rng)
        own = keys[shared:]
        # back up the new part as one or two nodes, each with its chain before it
        cut = rng.randint(1, len(own) - 1) if len(own) > 1 and rng.random() < 0.5 else len(own)
        nodes = [(shared, shared + cut)] + ([(shared + cut, len(keys))] if cut < len(own) else [])
        for lo, hi in nodes:
            res = rig.backup(injector, keys[lo:hi], keys[:lo])
            assert 0 <= res.completed_pages <= hi - lo
        # query a prefix of the chain, the chain, or the chain plus unknown pages
        choice = rng.random()
        if choice < 0.3:
            span = keys[: rng.randint(1, len(keys))]
        elif choice < 0.8:
            span = keys
        else:
            span = keys + [f"unknown/{r}/{i}" for i in range(3)]
        bound = rig.clean_hit(inner, span)
        q = cf.query_span(injector, span, rig.target if rig.stack is None else rig.stack)
        assert 0 <= q.kv_hit_pages <= bound <= len(span)
        pre = rig.prefetch(injector, span)
        assert pre.hit_pages <= bound, (r, pre.hit_pages, bound)
        if pre.hit_pages < len(span):
            rig.short_rounds += 1


def clean_round(rig, inner):
    """Injector off: re-back up every conversation through the bare KvtierStore (put-if-absent
    fills whatever failed earlier) and restore each completely, byte-exact."""
    for i, keys in enumerate(rig.chains):
        res = rig.backup(inner, keys, [])
        assert res.completed_pages == len(keys)
        if i % 4 == 0 or len(keys) > 128:
            assert rig.clean_hit(inner, keys) == len(keys)
            pre = rig.prefetch(inner, keys)
            assert pre.hit_pages == len(keys) and pre.kv_pages == len(keys)
            for s in rig.specs:
                want = 1 if s.is_trailing else len(keys)
                assert pre.counts[s.name] == want, s.name
    fresh = [f"fresh/{i}" for i in range(7)]
    assert rig.backup(inner, fresh, []).completed_pages == 7
    pre = rig.prefetch(inner, fresh)
    assert pre.hit_pages == 7 and pre.counts[PoolName.KV] == 7


def make_injected(monkeypatch, rig, *, failure=None, delay=None):
    for var, value in (
        ("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", failure),
        ("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", delay),
    ):
        if value is None:
            monkeypatch.delenv(var, raising=False)
        else:
            monkeypatch.setenv(var, str(value))
    backend = cf.create_backend("dynamic", rig.cfg, rig.target)
    assert type(backend) is HiCacheStorageFailureInjector
    inner = backend._backend
    assert type(inner) is KvtierStore
    cf.attach_backend(backend, rig.target)  # the injector forwards registration
    assert inner._anchor_is_logical == rig.logical
    if rig.stack is not None:
        assert set(inner._plans) == {str(s.name) for s in rig.specs if not s.is_anchor}
    return backend, inner


@pytest.mark.parametrize(
    "kind,use_v1",
    [("mha", True), ("mha", False), ("dsv4", True), ("dsv4", False)],
    ids=["mha-v1", "mha-legacy", "dsv4-v1", "dsv4-legacy"],
)
def test_random_failures_never_corrupt(monkeypatch, kind, use_v1):
    rig = Rig(kind, use_v1)
    injector, inner = make_injected(monkeypatch, rig, failure=0.2)
    run_rounds(rig, injector, inner, seed=1234)
    assert rig.restored_pages > 0  # something did get through
    assert rig.short_rounds > 0  # and failures did bite (p = 0.2 per call over 40 rounds)
    assert inner.get_stats()["objects"] > 0
    clean_round(rig, inner)
    inner.close()


@pytest.mark.parametrize("kind", ["mha", "dsv4"])
def test_random_delay_and_failures(monkeypatch, kind):
    rig = Rig(kind, use_v1=True)
    injector, inner = make_injected(monkeypatch, rig, failure=0.2, delay=0.001)
    assert injector._random_delay_limit == pytest.approx(0.001)
    run_rounds(rig, injector, inner, seed=99)
    clean_round(rig, inner)
    inner.close()


def test_random_delay_alone_loses_nothing(monkeypatch):
    rig = Rig("mha", use_v1=True)
    injector, inner = make_injected(monkeypatch, rig, delay=0.001)
    rng = random.Random(7)
    for r in range(10):
        keys, shared = rig.random_chain(rng)
        rig.backup(injector, keys, [])
        assert rig.clean_hit(inner, keys) == len(keys)
        pre = rig.prefetch(injector, keys)
        assert pre.hit_pages == len(keys) and pre.counts[PoolName.KV] == len(keys)
    inner.close()
