#!/usr/bin/env bash
# Build kvtier's wheel with the `kvtier` command in it (issue 27): `pip install` of the wheel
# gives the Python module (kvtier._native, abi3: one wheel for CPython >= 3.11) and the
# `kvtier` command (serve, master, stat, inspect, fsck, config check, bench) in the
# environment's bin/, and installs without a Rust toolchain.
#
# How: the release `kvtier` binary (debug info stripped) is staged as kvtier.data/scripts/kvtier
# and named as maturin's wheel data directory (`data` in [tool.maturin], added to
# pyproject.toml for the length of the build and restored after: maturin refuses a `data`
# directory that does not exist, so it cannot stay there for `maturin develop`). The wheel
# carries it as kvtier-<v>.data/scripts/kvtier, which pip installs into bin/ as an executable.
# A plain `maturin build` / `maturin develop` gives the Python module alone.
#
# Usage: scripts/build_wheel.sh [OUT_DIR]   (default dist/); prints the wheel's path.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-dist}
MATURIN=${MATURIN:-$(command -v maturin || echo .venv/bin/maturin)}
cargo build --release --quiet -p kvtier-cli
stage=kvtier.data
rm -rf "$stage"
cp pyproject.toml "$stage.pyproject.bak"
restore() { mv -f "$stage.pyproject.bak" pyproject.toml 2>/dev/null || true; rm -rf "$stage"; }
trap restore EXIT
trap 'exit 130' INT TERM
grep -q '^data = ' pyproject.toml && { echo "pyproject.toml already names a data dir" >&2; exit 2; }
sed -i "s|^\[tool.maturin\]\$|[tool.maturin]\ndata = \"$stage\"|" pyproject.toml
grep -q "^data = \"$stage\"" pyproject.toml || { echo "cannot add data to [tool.maturin]" >&2; exit 2; }
mkdir -p "$stage/scripts"
strip --strip-debug -o "$stage/scripts/kvtier" target/release/kvtier
chmod 0755 "$stage/scripts/kvtier"
mkdir -p "$OUT"
"$MATURIN" build --release --quiet --out "$OUT" >&2
ls -t "$OUT"/kvtier-*.whl | head -1
