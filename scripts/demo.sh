#!/usr/bin/env bash
# Set up everything (scripts/setup.sh) and run kvtier's demo: a multi-turn DeepSeek-V4-style
# workload through the real SGLang backend on the embedded store. Extra arguments go to the
# demo (python -m kvtier_dev.demo --help).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec env CUDA_VISIBLE_DEVICES="" "${KVTIER_VENV:-.venv}/bin/python" -W ignore -m kvtier_dev.demo "$@"
