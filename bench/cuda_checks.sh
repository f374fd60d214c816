#!/bin/bash
# Every check this repository runs on a CUDA GPU, in one go, bounded in time (about 9 minutes),
# most wanted first: `bench decode-speed --quick` (static forwards in CUDA graphs against the
# dynamic forward and transformers), the CUDA tests (kernels against their references, exactness,
# seeded sampling, CUDA graphs) and `vericache calibrate` for the simulator's model profiles (the
# 135M engine whole, 24B and 32B whole, 70B as a slice).
# Usage: bench/cuda_checks.sh OUTDIR
#   (writes run.log, decode_speed_cuda_<gpu>.json, pytest.log, calibrate_<gpu>_<arch>.json)
set -u
out=${1:?usage: bench/cuda_checks.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log=$out/run.log
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cd 'A-Za-z0-9' | tr A-Z a-z)
start=$(date +%s)
stamp() { echo "=== $(( $(date +%s) - start )) s: $*" >> "$log"; }
stamp start
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep 'Model name';
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} >> "$log" 2>&1
calibrate() {  # ARCH SECONDS
  stamp "calibrate $1"
  timeout "$2" python3 -m vericache.cli.main calibrate --device cuda --arch "$1" \
    --out "$out/calibrate_${gpu}_$1.json" >> "$log" 2>&1
  stamp "calibrate $1: exit $?"
}
stamp decode-speed
timeout 80 python3 -m vericache.cli.main bench decode-speed --quick --device cuda \
  --json "$out/decode_speed_cuda_${gpu}.json" >> "$log" 2>&1
stamp "decode-speed: exit $?"
stamp pytest
timeout 200 python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_cuda_graphs.py \
  tests/test_cuda_sampling.py tests/test_cuda.py tests/test_cuda_invariant.py \
  tests/test_long_context_cuda.py > "$out/pytest.log" 2>&1
stamp "pytest: exit $?"
calibrate smollm2-135m 70
calibrate mistral-small-24b 65
calibrate qwen2.5-32b 65
calibrate llama-3.1-70b 60
stamp end
