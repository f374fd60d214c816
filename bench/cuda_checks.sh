#!/bin/bash
# Every check this repository runs on a CUDA GPU, in one go, within 9 minutes, in this order:
#   1. `bench decode-speed --quick` (static forwards in CUDA graphs against the dynamic forward
#      and transformers);
#   2. the CUDA tests (kernels against their references, exactness, seeded sampling, CUDA graphs);
#   3. `vericache calibrate` for the simulator's model profiles (the 135M engine whole, 24B and
#      32B whole, 70B as a slice);
#   4. `bench long-context --quick` and `bench stagger --quick`.
# Each step has a limit of its own and none runs past the whole budget (a step that would have
# under 15 s left is skipped, and run.log says so), so the last steps get what the first left.
# Usage: bench/cuda_checks.sh OUTDIR
#   (writes run.log, pytest.log, and decode_speed_cuda_<gpu>.json, calibrate_<gpu>_<arch>.json,
#    long_context_cuda_<gpu>.json, stagger_cuda_<gpu>.json)
set -u
out=${1:?usage: bench/cuda_checks.sh OUTDIR}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log=$out/run.log
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cd 'A-Za-z0-9' | tr A-Z a-z)
start=$(date +%s)
deadline=$(( start + 535 ))
stamp() { echo "=== $(( $(date +%s) - start )) s: $*" >> "$log"; }
# run NAME SECONDS COMMAND...: COMMAND under the smaller of SECONDS and what the budget has left.
run() {
  local name=$1 want=$2 left
  shift 2
  left=$(( deadline - $(date +%s) ))
  if (( left < 15 )); then stamp "$name: skipped, ${left} s of the budget left"; return; fi
  stamp "$name (limit $(( want < left ? want : left )) s)"
  timeout $(( want < left ? want : left )) "$@" >> "$log" 2>&1
  stamp "$name: exit $?"
}
stamp start
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; lscpu | grep 'Model name';
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} >> "$log" 2>&1
vericache=(python3 -m vericache.cli.main)
run decode-speed 80 "${vericache[@]}" bench decode-speed --quick --device cuda \
  --json "$out/decode_speed_cuda_${gpu}.json"
run pytest 200 sh -c "python3 -m pytest -q -n 4 -p no:cacheprovider tests/test_cuda_graphs.py \
  tests/test_cuda_sampling.py tests/test_cuda.py tests/test_cuda_invariant.py \
  tests/test_long_context_cuda.py > '$out/pytest.log' 2>&1"
for arch in smollm2-135m:70 mistral-small-24b:65 qwen2.5-32b:65 llama-3.1-70b:60; do
  run "calibrate ${arch%%:*}" "${arch##*:}" "${vericache[@]}" calibrate --device cuda \
    --arch "${arch%%:*}" --out "$out/calibrate_${gpu}_${arch%%:*}.json"
done
run long-context 60 "${vericache[@]}" bench long-context --quick --device cuda \
  --json "$out/long_context_cuda_${gpu}.json"
run stagger 60 "${vericache[@]}" bench stagger --quick --device cuda \
  --json "$out/stagger_cuda_${gpu}.json"
stamp end
