#!/usr/bin/env bash
# The size study, prepared for one GPU: does the CLLM's own gain grow with the target's size?
# (+0.08 / +0.11 / +0.18 tokens per forward at 1.9M / 5.3M / 17.3M on the CPU,
# benchmarks/distill_ablations.md.) For each size:
#   1. `cllm pretrain` a Llama target on the stdlib corpus of this machine's own Python (bf16
#      autocast, on $DEVICE: `cllm pretrain --device`);
#   2. `cllm distill` with the shipped recipe (distill's defaults) on it: fewer prompts and steps
#      than the shipped run, no draft table (it plays no part in tokens per forward);
# then scripts/scale_table.py writes one table, target against CLLM at every size, to
# $OUT/scale_table.md and .json (the machine in its header), beside $OUT/study.log and each
# size's evaluation.json. The runs themselves go to $WORK (default runs/scale-study), not $OUT,
# so that $OUT stays a handful of files. Rerunning resumes: finished stages are skipped.
#
#   bash scripts/gpu_scale_study.sh                 # both sizes (benchmarks/scale-study/COMMAND.md)
#   ONLY=30m bash scripts/gpu_scale_study.sh        # one of them
#   SIZE=tiny bash scripts/gpu_scale_study.sh       # two ~0.2M targets on the CPU: the test's run
#
# Sizing (estimates, not measurements: the first GPU run's study.log and the table's stage seconds
# say what it really took). The stdlib corpus is about 2.4M training tokens (BPE 8192), so data,
# not the card, bounds pretraining: both sizes see the same 1,200 steps x 32 windows x 512 tokens
# = 19.7M tokens, about 8 epochs (the shipped 5.3M target saw 5.4). At 6N FLOPs a token that is
# 3.5 PFLOP for 30M (512 x 8) and 14.7 for 124M (896 x 12): at 10-25% of the H100's ~990 TFLOP/s
# bf16 peak (transformers' eager Llama, float32 weights under autocast, at these widths), about
# 0.5 and 1-2.5 minutes, plus tokenizing the corpus. Distillation on 384 prompts x 128 tokens and
# 100 steps: each step decodes 6 rollouts of 128 tokens one token a forward (~5-10 ms each at
# these depths), so 1-2 minutes of training, and the final evaluation (both models in float32
# on the GPU) at most about as long. Altogether about 7-10 minutes; each size alone (ONLY=) stays
# inside one 10-minute device command.
#
# Settings (environment): SIZES ("NAME:WIDTH:LAYERS:HEADS:STEPS:LR ...", min lr = lr / 10), ONLY
# (names to run), CONTEXT, BATCH, VOCAB, MAX_FILES (pretraining corpus files per split), DEVICE,
# BF16, THREADS, DISTILL_PROMPTS, DISTILL_STEPS, COLLECT_BATCH, EVAL_COUNT, TRAIN_EVAL_COUNT,
# EVAL_NEW_TOKENS, PYTHON, OUT, WORK.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PYTHONUNBUFFERED=1
py="${PYTHON:-python3}"

if [[ "${SIZE:-gpu}" == tiny ]]; then  # the CPU check: same stages, minutes on 2 cores
  : "${SIZES:=tiny-a:64:2:2:150:3e-3 tiny-b:64:3:2:150:3e-3}" "${CONTEXT:=256}" "${BATCH:=8}" "${VOCAB:=512}"
  : "${MAX_FILES:=40}" "${DEVICE:=cpu}" "${BF16:=false}" "${THREADS:=1}" "${DISTILL_PROMPTS:=16}"
  : "${DISTILL_STEPS:=3}" "${COLLECT_BATCH:=8}" "${EVAL_COUNT:=4}" "${TRAIN_EVAL_COUNT:=2}" "${EVAL_NEW_TOKENS:=32}"
elif [[ "${SIZE:-gpu}" != gpu ]]; then
  echo "gpu_scale_study: SIZE is 'gpu' (default) or 'tiny', not '$SIZE'" >&2
  exit 2
fi
: "${SIZES:=30m:512:8:8:1200:1e-3 120m:896:12:14:1200:5e-4}" "${CONTEXT:=512}" "${BATCH:=32}" "${VOCAB:=8192}"
: "${MAX_FILES:=}" "${DEVICE:=cuda}" "${BF16:=true}" "${THREADS:=4}" "${DISTILL_PROMPTS:=384}"
: "${DISTILL_STEPS:=100}" "${COLLECT_BATCH:=64}" "${EVAL_COUNT:=32}" "${TRAIN_EVAL_COUNT:=16}" "${EVAL_NEW_TOKENS:=64}"
: "${ONLY:=}"
out="${OUT:-scale-study-out}"
work="${WORK:-runs/scale-study}"
mkdir -p "$out" "$work"
exec > >(tee -a "$out/study.log") 2>&1  # everything below: the terminal and the log
trap 'echo "gpu_scale_study: failed (exit $?) at: $BASH_COMMAND" >&2' ERR

log() { echo "[$(date +%H:%M:%S)] $*"; }
stage() {  # stage NAME COMMAND...: run it; its wall seconds go to $work/stage_seconds.tsv
  local name="$1" t0=$SECONDS
  shift
  log "== $name"
  "$@"
  printf '%s\t%s\n' "$name" "$((SECONDS - t0))" >> "$work/stage_seconds.tsv"
  log "== $name done in $((SECONDS - t0)) s"
}

specs=()  # the sizes to run: SIZES, or those of them ONLY names
for spec in $SIZES; do
  if [[ -z "$ONLY" || " $ONLY " == *" ${spec%%:*} "* ]]; then
    specs+=("$spec")
  fi
done
if [[ ${#specs[@]} -eq 0 ]]; then
  echo "gpu_scale_study: ONLY='$ONLY' names none of SIZES='$SIZES'" >&2
  exit 2
fi
log "size study: SIZES='$SIZES'${ONLY:+ ONLY='$ONLY'} device $DEVICE, bf16 $BF16, out $out, work $work"
if [[ "$DEVICE" == cuda* ]]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  "$py" -c "import sys, torch; assert torch.cuda.is_available(), 'no CUDA device'
print('python', sys.version.split()[0], 'torch', torch.__version__, 'CUDA', torch.version.cuda)"
fi
# 0. the corpus (this Python's standard library, as `cllm pretrain` reads it) and the BPE tokenizer
# every size shares, trained on its train split as `cllm pretrain` would train its own
tokenizer_dir="$work/tokenizer-$VOCAB${MAX_FILES:+-files$MAX_FILES}"
corpus_and_tokenizer() {
  "$py" - "$VOCAB" "$MAX_FILES" "$tokenizer_dir" <<'PY'
import json
import sys
from pathlib import Path

from cllm.data.corpus import load_corpus
from cllm.data.tokenizer import save_tokenizer, train_tokenizer

vocab, max_files, folder = int(sys.argv[1]), int(sys.argv[2]) if sys.argv[2] else None, Path(sys.argv[3])
splits = {s: load_corpus(s, max_files=max_files) for s in ("train", "validation")}
print(json.dumps({s: c.describe() for s, c in splits.items()}))
if not (folder / "tokenizer.json").is_file():
    save_tokenizer(train_tokenizer((d.text for d in splits["train"].documents), vocab_size=vocab), folder)
print(f"tokenizer: {folder}")
PY
}
stage corpus corpus_and_tokenizer

runs=()
for spec in "${specs[@]}"; do
  IFS=: read -r name width layers heads steps lr <<< "$spec"
  dir="$work/$name"
  min_lr=$("$py" -c "print(float('$lr') / 10)")
  # 1. the target
  stage "$name/pretrain" "$py" -m cllm.cli pretrain --device "$DEVICE" --out "$dir/pretrain" --vocab-size "$VOCAB" --width "$width" \
    --layers "$layers" --heads "$heads" --context "$CONTEXT" --steps "$steps" --batch-size "$BATCH" --lr "$lr" \
    --min-lr "$min_lr" --bf16 "$BF16" --eval-interval 200 --eval-batches 8 --checkpoint-interval 400 \
    --threads "$THREADS" --tokenizer "$tokenizer_dir" ${MAX_FILES:+--max-files "$MAX_FILES"}
  # 2. its CLLM: the shipped recipe, scaled down; evaluated on stdlib-val at n = 16 and 32
  stage "$name/distill" "$py" -m cllm.cli distill --model "$dir/pretrain" --out "$dir/distill" \
    --max-prompts "$DISTILL_PROMPTS" --collect-batch-size "$COLLECT_BATCH" --max-steps "$DISTILL_STEPS" \
    --eval-interval "$DISTILL_STEPS" --checkpoint-interval "$DISTILL_STEPS" --train-eval-count "$TRAIN_EVAL_COUNT" \
    --eval-count "$EVAL_COUNT" --eval-max-new-tokens "$EVAL_NEW_TOKENS" --eval-block-sizes 16,32 --drafts-prompts 0
  cp "$dir/distill/evaluation.json" "$out/evaluation-$name.json"
  runs+=(--run "$name=$dir")
done

# 3. the table
"$py" scripts/scale_table.py "${runs[@]}" --out "$out" --seconds "$work/stage_seconds.tsv" \
  --setting "device=$DEVICE" --setting "bf16 pretraining=$BF16" --setting "context=$CONTEXT" \
  --setting "pretraining batch=$BATCH windows" --setting "distill prompts=$DISTILL_PROMPTS" \
  --setting "distill steps=$DISTILL_STEPS" --setting "held-out prompts=$EVAL_COUNT x $EVAL_NEW_TOKENS tokens"
log "size study done in $SECONDS s: $out/scale_table.md"
