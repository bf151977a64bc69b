#!/usr/bin/env bash
# The prepared GPU run of the step-cost profile (under 7 minutes on one H200: each step is capped by `timeout`):
#   1. `cllm profile` of the ~1B and ~7B Llama shapes, random weights, bfloat16, 512 cached tokens (the lean
#      runner; the 1B shape again on transformers' forward);
#   2. `cllm tune` of the shipped target, float32 (the dtype the CLI decodes in).
# Results go to $OUT (the device runner's output folder) when set, else benchmarks/step-cost-gpu.
#
#   bash scripts/gpu_profile.sh
set -uo pipefail  # a step that fails or runs out of time is reported; the next one still runs
cd "$(dirname "$0")/.." || exit 1
out="${OUT:-benchmarks/step-cost-gpu}"
mkdir -p "$out"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
py="${PYTHON:-python}"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" || true
for shape in 1b 7b; do
  timeout 125 "$py" -m cllm.cli profile --shape "$shape" --device cuda --dtype bfloat16 \
    --repeats 20 --host-tokens 16 --out "$out/$shape" 2>&1 | tee "$out/$shape.log" || echo "profile $shape: exit $?" >&2
done
# the same 1B shape on transformers' forward: the lean runner's gain on a GPU
timeout 90 "$py" -m cllm.cli profile --shape 1b --device cuda --dtype bfloat16 --forward transformers \
  --repeats 20 --host-tokens 16 --out "$out/1b-transformers" 2>&1 | tee "$out/1b-transformers.log" \
  || echo "profile 1b transformers: exit $?" >&2
timeout 40 "$py" -m cllm.cli tune --model models/stdlib-coder --device cuda --dtype float32 \
  --out "$out/decode_defaults-stdlib-coder.json" --force 2>&1 | tee "$out/tune.log" || echo "tune: exit $?" >&2
