"""The host KV-event stream names kvtier's tier (issue 30): a page in DRAM is published with
vLLM's ``CPU`` medium, a page on the SSD tier with ``STORAGE``, and a write-back demotion is
``BlockStored`` ``STORAGE`` before ``BlockRemoved`` ``CPU`` (the order vLLM's tracker counts
residencies in), so a router never sees a page kvtier still holds as absent.

Real parts: a real ``kvtier serve`` with its SSD tier (write-back, in the test's directory) and
the host stream on 127.0.0.1 (port 0), a real client in server mode, pyzmq SUB on kvtier's PUB,
SGLang 0.5.23's and vLLM 0.34's msgspec decoders. The oracle is kvtier itself: where each page
lives is read with ``kvtier inspect --socket`` (DRAM and SSD bytes per key), never from the
stream.
"""

from __future__ import annotations

import json
import subprocess
import time

import test_host_events as he

kvtier_bin = he.kvtier_bin


def placements(served):
    """Page hash -> (in DRAM, on SSD), from ``kvtier inspect`` (a page is in a tier while any
    of its objects is)."""
    out = subprocess.run(
        [str(served.binary), "inspect", "--socket", served.socket, "--prefix", "", "--json"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.returncode in (0, 1) and out.stdout.strip(), out.stderr[-2000:]
    where: dict[str, tuple[bool, bool]] = {}
    for store in json.loads(out.stdout)["stores"]:
        assert not store.get("truncated"), store
        for p in store["prefix"]:
            page = p["key"].rpartition("\x1f")[2].partition("@")[0]
            dram, ssd = where.get(page, (False, False))
            where[page] = (dram or p["dram_bytes"] is not None, ssd or p["ssd_bytes"] is not None)
    return where


def residencies(served, pages):
    """Event hash -> the media kvtier holds the page on (vLLM's names), for the pages it holds."""
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    where = placements(served)
    return {
        hash_str_to_int64(p): {m for m, on in zip(("CPU", "STORAGE"), where[p]) if on}
        for p in pages
        if p in where
    }


class Residencies:
    """A router counting residencies per (hash, medium), as vLLM's tracker does; it notes any
    page whose last residency went away (the router would stop crediting it)."""

    def __init__(self):
        self.held: dict[int, set[str]] = {}
        self.vanished: set[int] = set()

    def apply(self, batch):
        for ev in batch.events:
            kind = type(ev).__name__
            if kind == "AllBlocksCleared":
                self.held.clear()
                continue
            assert ev.medium in ("CPU", "STORAGE"), ev.medium
            for h in ev.block_hashes:
                media = self.held.setdefault(h, set())
                if kind == "BlockStored":
                    assert ev.medium not in media, f"{h} stored twice on {ev.medium}"
                    media.add(ev.medium)
                else:
                    assert ev.medium in media, f"{h} removed from {ev.medium}, never stored"
                    media.discard(ev.medium)
                    if not media:
                        del self.held[h]
                        self.vanished.add(h)


def test_pages_are_published_with_the_tier_that_holds_them(kvtier_bin, tmp_path):
    from sglang.srt.mem_cache.utils import hash_str_to_int64

    vdec, sdec = he.decoders()
    ssd = tmp_path / "ssd"
    served = he.serve(
        kvtier_bin,
        tmp_path,
        "--engine",
        "ssd_enabled=true",
        "--engine",
        f"ssd_storage_dir={ssd}",
        "--engine",
        "ssd_write_policy=write_back",
        "--engine",
        "ssd_capacity_bytes=64MiB",
        "--engine",
        "ssd_segment_size_bytes=4MiB",
    )
    router = None
    try:
        router = he.Router(*he.endpoints(served))
        store = he.client(served)
        # 24 pages (48 objects of 64 KiB) into 1 MiB of DRAM: two thirds are demoted to SSD.
        pages = [he.page_hash(i, "media") for i in range(24)]
        for i in range(0, 24, 4):
            he.put_pages(store, pages[i : i + 4])
        router.receive()
        seqs = sorted(router.live)
        assert seqs == list(range(seqs[0], seqs[-1] + 1)), "lost batches"
        credit = Residencies()
        for seq in seqs:
            credit.apply(vdec.decode(router.live[seq]))
            sdec.decode(router.live[seq])  # SGLang's classes read the same batches
        by_hash = {hash_str_to_int64(p): p for p in pages}
        want = residencies(served, pages)
        assert credit.held == want, {by_hash[h]: (credit.held.get(h), want.get(h)) for h in by_hash}
        demoted = [h for h, m in want.items() if m == {"STORAGE"}]
        assert len(demoted) >= 8, f"nothing demoted: {want}"
        assert {"CPU"} in want.values()
        # Demotion is stored-then-removed: no page kvtier kept was ever shown absent.
        assert credit.vanished == set()
        # A late router's snapshot names each page once per medium, the same residencies.
        seq, payload = router.snapshot(b"")
        snap = Residencies()
        snap.apply(vdec.decode(payload))
        assert seq == seqs[-1] and snap.held == want

        # An explicit remove of a demoted page: BlockRemoved STORAGE.
        gone = by_hash[demoted[0]]
        assert store.remove_keys(he.sglang_keys(gone)) >= 1
        router.receive()
        for s in sorted(router.live):
            if s > seq:
                credit.apply(vdec.decode(router.live[s]))
        assert demoted[0] not in credit.held and credit.vanished == {demoted[0]}
    finally:
        if router is not None:
            router.close()
        served.stop()


def test_a_ring_loss_is_repaired_from_what_the_store_holds(kvtier_bin, tmp_path):
    """An engine ring far too small for the traffic between two drains (4 events, 1.5 s
    apart) loses events; the stream then re-reads what the store holds and publishes the
    difference, so the router still credits exactly the pages kvtier holds and a snapshot
    says the same. Without the resync the router would credit at most the ring's 4."""

    vdec, _ = he.decoders()
    config = tmp_path / "serve.toml"
    config.write_text("host_events_engine_ring = 4\nhost_events_interval_ms = 1500\n")
    config.chmod(0o600)
    served = he.serve(kvtier_bin, tmp_path, "--config", str(config), dram="8MiB")
    router = None
    try:
        router = he.Router(*he.endpoints(served))
        store = he.client(served)
        pages = [he.page_hash(i, "loss") for i in range(40)]
        for i in range(0, 40, 8):
            he.put_pages(store, pages[i : i + 8])
        doc = served.wait_for(
            "an engine ring loss",
            lambda d: d["server"]["host_events"]["engine_dropped"] > 0,
        )
        assert doc["server"]["host_events"]["engine_dropped"] > 0
        # The drain after the loss publishes the resync: wait one interval and then some.
        time.sleep(2.0)
        router.receive(timeout=2.0)
        credit = Residencies()
        for seq in sorted(router.live):
            credit.apply(vdec.decode(router.live[seq]))
        want = residencies(served, pages)
        assert len(want) == 40, f"kvtier should hold every page: {len(want)}"
        assert credit.held == want, (len(credit.held), len(want))
        seq, payload = router.snapshot(b"")
        snap = Residencies()
        snap.apply(vdec.decode(payload))
        assert snap.held == want
    finally:
        if router is not None:
            router.close()
        served.stop()
