#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run every kvtier test: formatting and lint gates, the Rust
# tests of every crate, then the Python tests that drive kvtier through real SGLang 0.5.23
# classes. Fails loudly when a runner collects no tests.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${KVTIER_VENV:-.venv}

bash scripts/setup.sh

echo "[test] cargo fmt --check"
cargo fmt --all -- --check
echo "[test] cargo clippy -D warnings"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "[test] ruff (Python format and lint)"
"$VENV/bin/ruff" format --check --quiet python tests/python tools/python
"$VENV/bin/ruff" check --quiet --select E9,F63,F7,F82,F401,F841 python tests/python tools/python
echo "[test] cargo test (release: the concurrency and property tests run many more cases)"
cargo test --workspace --release --quiet 2>&1 | tee target/cargo-test.log
if ! grep -qE '^test result: ok\. [1-9][0-9]* passed' target/cargo-test.log; then
  echo "[test] cargo test ran no test" >&2
  exit 1
fi

echo "[test] pytest"
set +e
CUDA_VISIBLE_DEVICES="" "$VENV/bin/python" -m pytest tests/python -q -p no:cacheprovider "$@"
status=$?
set -e
if [ $status -eq 5 ]; then
  echo "[test] pytest collected no tests: failing" >&2
  exit 1
fi
exit $status
