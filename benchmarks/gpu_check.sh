#!/usr/bin/env bash
# GPU readiness check (see benchmarks/gpu_check.py): unit tests with CUDA, mg train throughput and MFU,
# checkpoint and generation speed, multi-GPU parity; at most 8 minutes; writes $OUT/gpu_check.json.
#
#   bash benchmarks/gpu_check.sh              # on a machine with NVIDIA GPUs
#   bash benchmarks/gpu_check.sh --dry-run    # every step with tiny shapes on the CPU, under 2 minutes
#   OUT=results bash benchmarks/gpu_check.sh --only unit,train
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [[ -x "$repo/.venv/bin/python" ]]; then
    python="$repo/.venv/bin/python"
else
    python="$(command -v python3)"
fi
exec "$python" "$repo/benchmarks/gpu_check.py" "$@"
