#!/usr/bin/env bash
# The GPU checks, in one call of a lent machine (about 5 minutes on one H100 / H200), from the
# repository root: the `gpu` tests (the runtime on CUDA equal to eager, fused attention against
# eager's own kernels), then bench/gpu_step.py, whose JSON line goes to docs/results/ under the
# GPU's name and today's date. Its output is what to commit. Needs a venv with torch for CUDA
# (`pip install -e .` with a CUDA torch); without CUDA the tests skip and gpu_step exits 2.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-docs/results}
mkdir -p "$out"
gpu=$(python -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower() if torch.cuda.is_available() else 'none')")
day=$(date -u +%F)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout 240 python -m pytest -q -m gpu tests/test_gpu.py 2>&1 | tee "$out/gpu_tests_${gpu}_${day}.log" | tail -20
timeout 180 python bench/gpu_step.py | tee -a "$out/gpu_step_${gpu}_${day}.jsonl"
