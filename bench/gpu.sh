#!/usr/bin/env bash
# GPU benchmarks for a ~0.5B Qwen2 shape: sampler and train-step tokens/s and MFU vs the measured bf16 matmul peak.
# Usage: bash bench/gpu.sh [OUT_DIR] [FLAGS]   (needs jax with CUDA; writes OUT_DIR/gpu_bench.json and a log;
# FLAGS go to `python -m sage_jax.bench gpu`, e.g. --quick for tiny shapes on any machine)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-${OUT:-.}}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION="${XLA_PYTHON_CLIENT_MEM_FRACTION:-0.9}"
python3 -c "import jax; print(jax.__version__, jax.devices())"
python3 -m sage_jax.bench gpu --out "$out/gpu_bench.json" "${@:2}" 2>&1 | tee "$out/gpu_bench.log"
