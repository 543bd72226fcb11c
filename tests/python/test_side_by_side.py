"""kvtier and SGLang's own HiCacheFile, side by side, on the same operations.

Both backends are attached to the *same* real SGLang host pools and driven through the
same real controller code (``kvtier_dev.harness.flows``: ``backup_span`` / ``query_span`` /
``prefetch_span``).  After every step the two must agree on ``kv_hit_pages`` and
``restorable_prefix_pages``; every prefetch must restore, page by page, exactly the bytes
that were in host memory when the page was backed up (checked with ``read_pages`` and, for
zero-copy pools, ``read_page_components``).

``extra_pool_hit_pages`` is checked pool by pool against each pool's own boundary over the
whole span, evaluated over what HiCacheFile has on disk (``own_verdicts``: kvtier's verdict
rule, ``crates/kvtier-proto/src/query.rs``). Where HiCacheFile evaluates a pool over the whole
span too (its KV run covers the span and the fold has not emptied), its number must be the
same; HiCacheFile evaluates only up to its KV run and omits 0, so elsewhere kvtier's number may
be larger, never smaller. On a logical anchor (DSV4) kvtier reports the KV entry as
``len(keys)`` (the anchor hits every page and the side pools decide) while HiCacheFile reports
its run of 0-byte KV files.

Scenario (per backend kind, with and without ``prefix_keys``):
  1. back up conversation A's first node (3 pages); query and prefetch A (140 pages, longer
     than what is stored);
  2. back up the rest of A (137 pages: KV in 128 + 9 page batches); query A, A + 3 unknown
     pages, prefetch A (restore also in two batches);
  3. conversation B shares A's first 20 pages and adds 6 of its own (only those are backed
     up, as the radix cache does); query / prefetch B;
  4. a span with a hole at page 5; query / prefetch it.
"""

from __future__ import annotations

import hashlib

import pytest

from sglang.srt.mem_cache.hicache_storage import HiCacheFile, PoolHitPolicy, PoolName

import kvtier_dev.harness.flows as cf
import kvtier_dev.harness.pools as sp
from kvtier.sglang import KvtierStore

from test_fixtures_selfcheck import ZeroCopyFile

DYNAMIC = {"backend_name": "kvtier", "module_path": "kvtier.sglang", "class_name": "KvtierStore"}


def hashes(n, tag):
    return [hashlib.sha256(f"{tag}/{i}".encode()).hexdigest() for i in range(n)]


# ---------------------------------------------------------------------------
# Each pool's own verdict (query.rs), evaluated over HiCacheFile's files
# ---------------------------------------------------------------------------


def own_verdicts(file: HiCacheFile, keys, transfers, logical_anchor):
    """Each pool's own boundary over the whole span, with HiCacheFile's files as the presence
    oracle: ALL_PAGES the first gap, TRAILING_PAGES the largest prefix whose window is there.
    Also returns the folded (kv_hit, restorable)."""
    n = len(keys)
    kv = n if logical_anchor else next((i for i in range(n) if not file.exists(keys[i])), n)
    verdicts = {PoolName.KV: kv}
    restorable = set(range(1, kv + 1))
    for t in transfers:
        present = [file.exists(file._log_key(t.name, k)) for k in keys]
        if t.hit_policy == PoolHitPolicy.ALL_PAGES:
            run = next((i for i in range(n) if not present[i]), n)
            accepts = set(range(1, run + 1))
        elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
            w = max(1, len(t.keys) if t.keys else 1)
            accepts = {p for p in range(1, n + 1) if all(present[max(0, p - w) : p])}
        else:
            raise AssertionError(f"policy {t.hit_policy} not used here")
        verdicts[t.name] = max(accepts, default=0)
        restorable &= accepts
    ordered = sorted(restorable)
    return (ordered[-1] if ordered else 0), verdicts, ordered


# ---------------------------------------------------------------------------
# One setup: pools + two backends + what was written
# ---------------------------------------------------------------------------


class SideBySide:
    def __init__(self, kind, file_dir, *, use_v1, with_prefix):
        self.kind = kind
        self.use_v1 = use_v1
        self.with_prefix = with_prefix
        if kind == "dsv4":
            self.stack = sp.build_dsv4_pool_group("page_first", device_full_pages=72)
            self.target = self.stack
            self.specs = self.stack.specs
            self.anchor = self.stack.anchor
            is_mla = True
        else:
            build = sp.build_mha_host_pool if kind == "mha" else sp.build_mla_host_pool
            self.anchor = build("page_first", size_pages=160)
            self.stack = None
            self.target = self.anchor
            self.specs = cf.as_group_and_specs(self.anchor)[1]
            is_mla = kind == "mla"
        self.logical = self.anchor.kv_buffer is None
        ec = {**DYNAMIC, "dram_capacity_bytes": "64MiB"}
        if use_v1:
            ec["interface_v1"] = 1
        self.kv = KvtierStore(sp.make_storage_config(is_mla=is_mla, extra_config=ec), {})
        file_cls = ZeroCopyFile if use_v1 else HiCacheFile
        self.file = file_cls(
            sp.make_storage_config(is_mla=is_mla, extra_config={"file_storage_path": file_dir})
        )
        cf.attach_backend(self.kv, self.target)
        cf.attach_backend(self.file, self.target)
        # truth[pool name][page hash] = (flat page bytes, component bytes)
        self.truth = {s.name: {} for s in self.specs}
        self.seed = 0
        self.steps = 0

    # -- pools --------------------------------------------------------------
    def pool(self, name):
        if self.stack is None:
            assert name == PoolName.KV
            return self.anchor
        return self.stack.group.entry_map[name].host_pool

    def swa(self):
        return None if self.stack is None else self.stack.spec(PoolName.SWA)

    def _snapshot(self, name, idx, keys):
        pool = self.pool(name)
        if sp.page_nbytes(pool) == 0:
            return
        flat = sp.read_pages(pool, idx)
        comps = sp.read_page_components(pool, idx)
        assert len(flat) == len(keys)
        for k, f, c in zip(keys, flat, comps):
            # put-if-absent on both sides: the first bytes under a key are the truth
            self.truth[name].setdefault(k, (f, c))

    def prefix(self, keys):
        return list(keys) if self.with_prefix else None

    # -- operations ---------------------------------------------------------
    def backup(self, keys, before):
        """Back up one node ``keys`` whose chain before it is ``before``."""
        self.seed += 1
        n = len(keys)
        kv_idx = sp.alloc_indices(self.anchor, n)
        per_pool = {PoolName.KV: kv_idx}
        swa_idx = None
        if self.stack is not None:
            swa = self.swa()
            swa_idx = sp.alloc_indices(swa.host_pool, min(swa.window_pages, n))
            per_pool[PoolName.SWA] = swa_idx
        for s in self.specs:
            if s.is_anchor and self.logical:
                continue
            on_swa = s.name == PoolName.SWA or s.indices_from_pool == PoolName.SWA
            idx = swa_idx if on_swa else kv_idx
            sp.fill_pages(s.host_pool, idx, self.seed)
            self._snapshot(s.name, idx, keys[-(idx.numel() // s.page_size) :])
        results = []
        for backend in (self.kv, self.file):
            results.append(
                cf.backup_span(
                    backend,
                    self.target,
                    keys,
                    per_pool,
                    prefix_keys=self.prefix(before),
                    use_v1=self.use_v1,
                )
            )
        rk, rf = results
        assert rk.completed_pages == rf.completed_pages == n
        assert rk.pool_hits == rf.pool_hits
        for s in self.specs:
            if not s.is_anchor:
                want = min(s.window_pages, n) if s.is_trailing else n
                assert rk.pool_hits[s.name] == want, s.name
        sp.free_indices(self.anchor, kv_idx)
        if swa_idx is not None:
            sp.free_indices(self.swa().host_pool, swa_idx)

    def query(self, keys, before=(), *, expect_hit=None, expect_restorable=None):
        self.steps += 1
        arg = self.stack if self.stack is not None else self.anchor
        qk = cf.query_span(self.kv, keys, arg, prefix_keys=self.prefix(before))
        qf = cf.query_span(self.file, keys, arg, prefix_keys=self.prefix(before))
        assert qk.kv_hit_pages == qf.kv_hit_pages, (qk, qf)
        assert qk.restorable_prefix_pages == qf.restorable_prefix_pages, (qk, qf)
        if expect_hit is not None:
            assert qk.kv_hit_pages == expect_hit
        if expect_restorable is not None:
            assert qk.restorable_prefix_pages == expect_restorable
        transfers = cf.build_prefetch_transfers(len(keys), self.specs)
        if transfers:
            self._check_verdicts(keys, transfers, qk, qf)
        else:
            # KV only: the controller asks batch_exists; the v2 form must agree too.
            vk = self.kv.batch_exists_v2(keys, [])
            vf = self.file.batch_exists_v2(keys, [])
            assert (vk.kv_hit_pages, vk.restorable_prefix_pages, vk.extra_pool_hit_pages) == (
                vf.kv_hit_pages,
                vf.restorable_prefix_pages,
                vf.extra_pool_hit_pages,
            )
            assert vk.kv_hit_pages == qk.kv_hit_pages
        return qk

    def _check_verdicts(self, keys, transfers, qk, qf):
        hit, verdicts, restorable = own_verdicts(self.file, keys, transfers, self.logical)
        assert (qk.kv_hit_pages, qk.restorable_prefix_pages) == (hit, restorable)
        fk, ff = dict(qk.extra_pool_hit_pages), dict(qf.extra_pool_hit_pages)
        assert fk == verdicts
        if not self.logical:
            assert fk[PoolName.KV] == ff.get(PoolName.KV, 0)
        file_covers_span = ff.get(PoolName.KV, 0) == len(keys)
        for t in transfers:
            if t.name in ff and file_covers_span:
                assert fk[t.name] == ff[t.name], (t.name, fk, ff)
            else:  # HiCacheFile stopped early or looked only up to its KV run
                assert fk[t.name] >= ff.get(t.name, 0), (t.name, fk, ff)

    def prefetch(self, keys, before=(), *, expect_hit):
        out = []
        for backend in (self.kv, self.file):
            hit_guess = len(keys)
            kv_idx = sp.alloc_indices(self.anchor, hit_guess)
            per_pool = {PoolName.KV: kv_idx}
            swa_idx = None
            if self.stack is not None:
                swa = self.swa()
                swa_idx = sp.alloc_indices(swa.host_pool, swa.window_pages)
                per_pool[PoolName.SWA] = swa_idx
            for s in self.specs:
                if s.is_anchor and self.logical:
                    continue
                on_swa = s.name == PoolName.SWA or s.indices_from_pool == PoolName.SWA
                sp.zero_pages(s.host_pool, swa_idx if on_swa else kv_idx)
            res = cf.prefetch_span(
                backend,
                self.target,
                keys,
                prefix_keys=self.prefix(before),
                use_v1=self.use_v1,
                host_indices_per_pool=per_pool,
            )
            assert res.hit_pages == expect_hit
            self._check_restored(res)
            out.append((res.hit_pages, res.kv_pages, dict(res.counts)))
            sp.free_indices(self.anchor, kv_idx)
            if swa_idx is not None:
                sp.free_indices(self.swa().host_pool, swa_idx)
        assert out[0] == out[1]
        return out[0]

    def _check_restored(self, res):
        hit = res.hit_pages
        if hit == 0:
            return
        assert res.counts[PoolName.KV] == hit
        for s in self.specs:
            want_n = min(s.window_pages, hit) if s.is_trailing else hit
            assert res.counts[s.name] == want_n, s.name
            if s.is_anchor and self.logical:
                continue
            pool = s.host_pool
            idx = res.host_indices[s.name][: want_n * s.page_size]
            keys = res.key_ranges[s.name][:want_n]
            if s.is_trailing:
                assert keys == res.key_ranges[PoolName.KV][hit - want_n : hit]
            got_flat = sp.read_pages(pool, idx)
            got_comp = sp.read_page_components(pool, idx)
            for k, f, c in zip(keys, got_flat, got_comp):
                wf, wc = self.truth[s.name][k]
                assert f == wf, (s.name, k)
                assert c == wc, (s.name, k)

    def close(self):
        self.kv.close()


CASES = [
    pytest.param(
        kind, v1, pfx, id=f"{kind}-{'v1' if v1 else 'legacy'}-{'prefix' if pfx else 'noprefix'}"
    )
    for kind in ("mha", "mla", "dsv4")
    for v1 in (False, True)
    for pfx in (True, False)
]


@pytest.mark.parametrize("kind,use_v1,with_prefix", CASES)
def test_side_by_side(file_storage_dir, kind, use_v1, with_prefix):
    t = SideBySide(kind, file_storage_dir, use_v1=use_v1, with_prefix=with_prefix)
    trailing = t.stack is not None  # DSV4: SWA window of 1 page at each node's end
    A = hashes(140, "A")

    # 1. partial backup: only A's first node
    t.backup(A[:3], [])
    t.query(A, expect_hit=3, expect_restorable=[3] if trailing else None)
    t.query(A[:2], expect_hit=0 if trailing else 2)
    t.prefetch(A, expect_hit=3)

    # 2. the rest of A: 137 pages, KV in 128 + 9 page batches
    t.backup(A[3:], A[:3])
    t.query(A, expect_hit=140, expect_restorable=[3, 140] if trailing else None)
    X = hashes(3, "unknown")
    t.query(A + X, expect_hit=140)
    hit, kv_pages, counts = t.prefetch(A, expect_hit=140)
    assert kv_pages == 140
    t.query(A[:100], expect_hit=3 if trailing else 100)

    # 3. a second conversation sharing A's first 20 pages
    B = A[:20] + hashes(6, "B")
    t.backup(B[20:], B[:20])
    t.query(B, expect_hit=26, expect_restorable=[3, 26] if trailing else None)
    t.prefetch(B, expect_hit=26)
    t.query(A, expect_hit=140)  # B did not disturb A

    # 4. a span with a hole at page 5
    holed = A[:5] + hashes(1, "hole") + A[6:12]
    t.query(holed, expect_hit=3 if trailing else 5)
    t.prefetch(holed, expect_hit=3 if trailing else 5)
    t.close()
