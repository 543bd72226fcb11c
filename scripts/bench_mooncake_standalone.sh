#!/usr/bin/env bash
# Mooncake Store's standalone-client mode, measured the way `kvtier bench server` measures
# kvtier serve: batches of 32 objects (256 KiB, 1 MiB), batch_put_from / batch_get_into from
# memory allocated by Mooncake's own host allocator (what SGLang's standalone mode requires),
# and one batch_is_exist over 128 pages x 7 objects (Mooncake has no multi-pool existence
# query; SGLang's Mooncake backend asks for every key).
#
# Not part of the test suite: it needs Mooncake from PyPI in its own venv and libibverbs
# (the "non-cuda" wheel still links RDMA verbs):
#   apt-get install -y libibverbs1
#   python3 -m venv /tmp/mcvenv && /tmp/mcvenv/bin/pip install mooncake-transfer-engine-non-cuda
#   bash scripts/bench_mooncake_standalone.sh /tmp/mcvenv
set -euo pipefail
VENV=${1:-/tmp/mcvenv}
MC=$("$VENV/bin/python" -c 'import mooncake, os; print(os.path.dirname(mooncake.__file__))')
export LD_LIBRARY_PATH="$MC:$MC/../mooncake_transfer_engine_non_cuda.libs:${LD_LIBRARY_PATH:-}"
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
"$MC/mooncake_master" --port 50051 >"$WORK/master.log" 2>&1 &
sleep 2
"$MC/mooncake_client" --master_server_address 127.0.0.1:50051 --metadata_server P2PHANDSHAKE \
  --protocol tcp --global_segment_size "2 GB" --port 50052 --host 127.0.0.1 >"$WORK/client.log" 2>&1 &
sleep 4
"$VENV/bin/python" - <<'PY' 2>&1 | grep -v '^[IWE][0-9]\{4\} \|^WARNING'
import ctypes, time, statistics, sys
from mooncake.store import MooncakeDistributedStore, MooncakeHostMemAllocator
batch = 32
RUN = int(time.time() * 1000)
sizes_kib = [256, 1024]
rounds = 20
max_obj = max(sizes_kib) * 1024
slots = 4
pool_len = batch * max_obj * slots
alloc = MooncakeHostMemAllocator()
ptr = alloc.alloc(pool_len)
ctypes.memset(ptr, 7, pool_len)
s = MooncakeDistributedStore()
rc = s.setup_dummy(pool_len, 16 << 20, "127.0.0.1:50052")
print("setup_dummy", rc, "register", s.register_buffer(ptr, pool_len), file=sys.stderr)
out = {}
for kib in sizes_kib:
    obj = kib * 1024
    sets, gets = [], []
    for r in range(rounds + 2):
        slot, nxt = r % slots, (r + 2) % slots
        keys = [f"k{RUN}-{kib}-{r}-{i}" for i in range(batch)]
        src = [ptr + slot * batch * max_obj + i * obj for i in range(batch)]
        dst = [ptr + nxt * batch * max_obj + i * obj for i in range(batch)]
        t = time.perf_counter(); res = s.batch_put_from(keys, src, [obj] * batch); ts = time.perf_counter() - t
        t = time.perf_counter(); got = s.batch_get_into(keys, dst, [obj] * batch); tg = time.perf_counter() - t
        assert all(x == 0 for x in res), res[:3]
        assert all(x == obj for x in got), got[:3]
        s.batch_remove(keys) if hasattr(s, "batch_remove") else None
        if r >= 2:
            sets.append(ts); gets.append(tg)
    b = batch * obj
    out[kib] = (b / statistics.median(sets) / 1e9, b / statistics.median(gets) / 1e9)
    print(f"mooncake standalone {kib} KiB x {batch}: set {out[kib][0]:.2f} GB/s get {out[kib][1]:.2f} GB/s")
keys = [f"e{RUN}-{i}" for i in range(128 * 7)]
for i in range(0, len(keys), 128):
    s.batch_put_from(keys[i:i+128], [ptr] * 128, [64] * 128)
lat = []
for _ in range(1000):
    t = time.perf_counter(); s.batch_is_exist(keys); lat.append((time.perf_counter() - t) * 1e6)
lat.sort()
print(f"mooncake batch_is_exist {len(keys)} keys one call: p50 {lat[len(lat)//2]:.1f} us p99 {lat[int(len(lat)*0.99)]:.1f} us")
PY
