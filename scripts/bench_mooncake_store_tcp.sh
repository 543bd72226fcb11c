#!/usr/bin/env bash
# Mooncake Store over its TCP transport, the baseline of `kvtier bench cluster`: one master, a
# "holder" client that contributes a 6 GB global segment (removes are lazy under its lease, so room for every batch) and a "reader" client that contributes
# none, so every byte the reader puts or gets crosses a TCP connection to the holder. Batches
# of 32 objects (512 KiB, 1 MiB, 2 MiB) with batch_put_from / batch_get_into from a registered
# buffer; fresh keys per batch, medians of 20 batches. Output: one line per size, and with
# --json PATH the same figures as JSON (what kvtier's bench reads).
#
# Not part of the test suite: it needs Mooncake from PyPI in its own venv and libibverbs
# (the "non-cuda" wheel still links RDMA verbs):
#   apt-get install -y libibverbs1
#   python3 -m venv /tmp/mcvenv && /tmp/mcvenv/bin/pip install mooncake-transfer-engine-non-cuda
#   bash scripts/bench_mooncake_store_tcp.sh /tmp/mcvenv [--json PATH]
set -euo pipefail
VENV=${1:-/tmp/mcvenv}
JSON=""
if [ "${2:-}" = "--json" ]; then JSON=${3:?--json needs a path}; fi
MC=$("$VENV/bin/python" -c 'import mooncake, os; print(os.path.dirname(mooncake.__file__))')
export LD_LIBRARY_PATH="$MC:$MC/../mooncake_transfer_engine_non_cuda.libs:${LD_LIBRARY_PATH:-}"
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT
read -r MASTER_PORT HOLDER_PORT READER_PORT < <("$VENV/bin/python" - <<'PY'
import socket
socks = [socket.socket() for _ in range(3)]
for s in socks:
    s.bind(("127.0.0.1", 0))
print(*[s.getsockname()[1] for s in socks])
PY
)
"$MC/mooncake_master" --port "$MASTER_PORT" >"$WORK/master.log" 2>&1 &
sleep 2

export MASTER="127.0.0.1:$MASTER_PORT" HOLDER="127.0.0.1:$HOLDER_PORT" READER="127.0.0.1:$READER_PORT"
export READY="$WORK/holder.ready" JSON
"$VENV/bin/python" - >"$WORK/holder.log" 2>&1 <<'PY' &
import os, time
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup(os.environ["HOLDER"], "P2PHANDSHAKE", 6 << 30, 16 << 20, "tcp", "", os.environ["MASTER"])
assert rc == 0, f"holder setup failed: {rc}"
open(os.environ["READY"], "w").close()
while True:
    time.sleep(1)
PY
for _ in $(seq 100); do [ -f "$READY" ] && break; sleep 0.1; done
[ -f "$READY" ] || { echo "mooncake holder did not start:"; cat "$WORK/holder.log"; exit 1; }

"$VENV/bin/python" - 2>&1 <<'PY' | grep -v '^[IWE][0-9]\{4\} \|^WARNING'
import ctypes, json, os, statistics, time
from mooncake.store import MooncakeDistributedStore, MooncakeHostMemAllocator
batch, rounds, sizes_kib = 32, 20, [512, 1024, 2048]
max_obj = max(sizes_kib) * 1024
pool_len = 2 * batch * max_obj
alloc = MooncakeHostMemAllocator()
ptr = alloc.alloc(pool_len)
ctypes.memset(ptr, 7, pool_len)
s = MooncakeDistributedStore()
# global_segment_size 0: the reader holds nothing, so the master places every object on the
# holder and every transfer goes over TCP.
rc = s.setup(os.environ["READER"], "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", os.environ["MASTER"])
assert rc == 0, f"reader setup failed: {rc}"
assert s.register_buffer(ptr, pool_len) == 0
run = int(time.time() * 1000)
report = {"batch": batch, "rounds": rounds, "sizes": {}}
for kib in sizes_kib:
    obj = kib * 1024
    sets, gets = [], []
    for r in range(rounds + 2):
        keys = [f"m{run}-{kib}-{r}-{i}" for i in range(batch)]
        src = [ptr + i * obj for i in range(batch)]
        dst = [ptr + batch * max_obj + i * obj for i in range(batch)]
        t = time.perf_counter(); res = s.batch_put_from(keys, src, [obj] * batch); ts = time.perf_counter() - t
        t = time.perf_counter(); got = s.batch_get_into(keys, dst, [obj] * batch); tg = time.perf_counter() - t
        assert all(x == 0 for x in res), [x for x in res if x != 0][:3]
        assert all(x == obj for x in got), got[:3]
        s.batch_remove(keys)
        if r >= 2:
            sets.append(ts); gets.append(tg)
    b = batch * obj
    put, get = b / statistics.median(sets) / 1e9, b / statistics.median(gets) / 1e9
    report["sizes"][str(kib)] = {"put_gbps": put, "get_gbps": get}
    print(f"mooncake store tcp {kib} KiB x {batch} (remote segment): put {put:.2f} GB/s get {get:.2f} GB/s")
if os.environ.get("JSON"):
    with open(os.environ["JSON"], "w") as f:
        json.dump(report, f, indent=1)
PY
