"""CLLMs against their target: free-running quality and plain-Jacobi speed, and the gates.

    python scripts/evaluate_cllm.py --target stdlib-coder --cllm stdlib-coder-cllm \
        --threads 2 --out benchmarks/cllm-evaluation

Each model decodes the first 64 HumanEval prompts (never trained on) and 100 stdlib-val prompts
spread over the set, greedy, 128 new tokens; `cllm.evaluation.gates.compare_models` measures parse /
degenerate / looping rates, the target's NLL of each model's greedy text, where it leaves the
target's, plain-Jacobi tokens per forward at n = 16 and 32 over all completions and over those
that do not loop (Jacobi output checked against greedy on every prompt), and the validation
loss over the whole stdlib-val split (`--no-val-loss` skips it). Several `--cllm NAME=PATH`
give one column each. Writes OUT/evaluation.json and OUT/README.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from cllm.evaluation.gates import QualitySettings, compare_models, gates, gates_table
from cllm.models import load_model, load_tokenizer, pad_token_id


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="stdlib-coder")
    ap.add_argument("--cllm", action="append", default=None,
                    help="a CLLM as PATH or NAME=PATH (repeatable; default: stdlib-coder-cllm)")
    ap.add_argument("--humaneval", type=int, default=64, help="first N HumanEval prompts (0: none)")
    ap.add_argument("--stdlib-val", type=int, default=100, help="N stdlib-val prompts spread over the set (0: none)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-sizes", default="16,32")
    ap.add_argument("--val-loss", action=argparse.BooleanOptionalAction, default=True,
                    help="also the validation loss over the whole stdlib-val split")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/cllm-evaluation")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cllms = {}
    for spec in args.cllm or ["stdlib-coder-cllm"]:
        name, _, path = spec.rpartition("=")
        cllms[name or path] = path
    sets = {k: v for k, v in (("humaneval", args.humaneval), ("stdlib-val", args.stdlib_val)) if v}
    settings = QualitySettings(prompt_sets=sets, block_sizes=[int(n) for n in args.block_sizes.split(",")],
                               max_new_tokens=args.max_new_tokens, val_loss=args.val_loss)
    tokenizer = load_tokenizer(args.target)
    models = {"target": load_model(args.target, dtype="float32")}
    models |= {name: load_model(path, dtype="float32") for name, path in cllms.items()}
    start = time.perf_counter()
    result = compare_models(models, tokenizer, settings, pad_id=pad_token_id(tokenizer),
                            progress=lambda msg: print(f"[{time.perf_counter() - start:6.0f} s] {msg}", flush=True))
    result["models"] = {"target": args.target, **cllms}
    result["gates"] = {name: [g.__dict__ for g in gates(result, name)] for name in cllms}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "evaluation.json").write_text(json.dumps(result, indent=2) + "\n")
    command = "python scripts/evaluate_cllm.py " + " ".join(sys.argv[1:])
    lines = ["# CLLMs against their target: greedy-text quality and plain-Jacobi speed", "",
             f"`{command}`", "",
             f"Greedy, {args.max_new_tokens} new tokens, float32; prompt sets: "
             + ", ".join(f"{name} ({count})" for name, count in sets.items())
             + "; models: " + ", ".join(f"`{n}` = `{p}`" for n, p in result["models"].items()) + ".", "",
             gates_table(result, list(models)), ""]
    for name, rows in result["gates"].items():
        lines += [f"Gates for `{name}` (pooled over the prompt sets):", "", "| gate | value | bar | |",
                  "|---|---|---|---|"]
        lines += [f"| {g['name']} | {g['value']:.4f} | {g['bar']} | {'pass' if g['passed'] else 'FAIL'} |"
                  for g in rows]
        lines.append("")
    (out / "README.md").write_text("\n".join(lines))
    print((out / "README.md").read_text())


if __name__ == "__main__":
    main()
