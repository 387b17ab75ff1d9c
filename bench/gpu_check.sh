#!/usr/bin/env bash
# The GPU checks, in one call of a lent machine (at most about 9 minutes on one H100 / H200), from
# the repository root:
#   1. the `gpu` tests (the runtime on CUDA equal to eager, fused attention against eager's own
#      kernels, profiling the device);
#   2. bench/one_device.py in bf16 on the published LLaMA-3.2-1B configuration at T = 2048 and
#      8192: eager, parallelize (default options, one Ray worker holding the GPU) and
#      torch.compile, each in a fresh process.
# Everything goes to $OUT (the device tool's folder) or docs/results/, named by the GPU and the
# date: what to commit. Needs python with a CUDA torch plus this project's dependencies; where
# .whl/ holds wheels (ray, pyomo, highspy for the GPU machine's python), they are installed into
# /tmp/site first. Without CUDA the tests skip and one_device's runs report their errors.
# bench/gpu_step.py (the zoo GPT in fp32 against eager) is a separate diagnostic.
set -u
cd "$(dirname "$0")/.."
out=${OUT:-docs/results}
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
gpu=$(python3 -c "import torch; print(torch.cuda.get_device_name(0).split()[1].lower() if torch.cuda.is_available() else 'none')")
day=$(date -u +%F)
log="$out/gpu_check_${gpu}_${day}.log"
{
  echo "# bench/gpu_check.sh, $(date -u +%FT%TZ), code $(git rev-parse --short HEAD 2>/dev/null)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
  python3 -c "import torch, ray, pyomo.version, numba, transformers; print('torch', torch.__version__, 'ray', ray.__version__, 'pyomo', pyomo.version.version, 'numba', numba.__version__, 'transformers', transformers.__version__)"
} 2>&1 | tee "$log"
timeout 200 python3 -m pytest -q -m gpu tests/test_gpu.py -p no:cacheprovider --timeout 180 2>&1 | tee -a "$log" | tail -15
timeout 370 python3 bench/one_device.py --device cuda --dtype bfloat16 --workloads llama1b --lengths 2048,8192 \
  --systems eager,parallelize,compile --steps 5 --warmup 2 --timeout 150 \
  --out "$out/gpu_one_device_${gpu}_${day}.jsonl" 2>&1 | tee -a "$log" | cut -c1-400
