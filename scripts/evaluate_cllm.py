"""The shipped CLLM's bars, measured against its target in one run (counts, not timing).

    python scripts/evaluate_cllm.py --target stdlib-coder --cllm stdlib-coder-cllm --count 64 \
        --block-sizes 8,16,32 --recycle 4 --blocks-in-flight 1 --threads 2 --out benchmarks/cllm-evaluation

1. HumanEval prompts (never trained on), greedy, 128 new tokens: Jacobi tokens per forward of
   target and CLLM at each block size with the reference's guess, and with n-gram recycling
   (+ multi-block when --blocks-in-flight > 1); every output compared token for token with the same model's greedy output.
2. Quality, the same measurement as the target's model card (`cllm.pretrain.evaluate_target`):
   validation loss over the whole stdlib-val split, and 128-token greedy completions of 100
   stdlib-val prompts (parse / degenerate / looping rates).

Writes OUT/evaluation.json and OUT/README.md.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

import torch

from cllm import greedy_decode, jacobi_decode
from cllm.data.prompts import load_prompts
from cllm.models import load_model, load_tokenizer, resolve_model_path
from cllm.pretrain import evaluate_target


def tokens_per_forward(model, prompts, greedy, eos, **kwargs) -> dict:
    new = forwards = same = 0
    for ids, want in zip(prompts, greedy, strict=True):
        out = jacobi_decode(model, ids, eos_token_id=eos, generator=torch.Generator().manual_seed(0), **kwargs)
        new, forwards = new + len(out.new_tokens[0]), forwards + out.forward_passes
        same += out.new_tokens[0] == want
    return {"tokens_per_forward": new / forwards, "equal_to_greedy": same, "prompts": len(prompts)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="stdlib-coder")
    ap.add_argument("--cllm", default="stdlib-coder-cllm")
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--count", type=int, default=64)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-sizes", default="16,32")
    ap.add_argument("--recycle", type=int, default=3)
    ap.add_argument("--blocks-in-flight", type=int, default=2)
    ap.add_argument("--quality-prompts", type=int, default=100, help="stdlib-val prompts completed for the quality rates")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/cllm-evaluation")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    tok = load_tokenizer(args.cllm)
    eos = tok.eos_token_id
    prompts = [torch.tensor([tok(p.text)["input_ids"]]) for p in load_prompts(args.prompts, limit=args.count)]
    result = {"settings": vars(args), "decoding": {}, "quality": {}}
    for role, name in (("target", args.target), ("cllm", args.cllm)):
        model = load_model(name, dtype="float32")
        greedy = [greedy_decode(model, ids, max_new_tokens=args.max_new_tokens, eos_token_id=eos).new_tokens[0]
                  for ids in prompts]
        rows = {}
        for n in map(int, args.block_sizes.split(",")):
            common = dict(block_size=n, max_new_tokens=args.max_new_tokens)
            rows[f"jacobi n={n}"] = tokens_per_forward(model, prompts, greedy, eos, **common)
            rows[f"recycle {args.recycle} + {args.blocks_in_flight} blocks, n={n}"] = tokens_per_forward(
                model, prompts, greedy, eos, recycle=args.recycle, blocks_in_flight=args.blocks_in_flight, **common)
            print(role, n, {k: round(v["tokens_per_forward"], 3) for k, v in rows.items()}, flush=True)
        result["decoding"][role] = rows
        evaluation = asdict(evaluate_target(resolve_model_path(name), n_prompts=args.quality_prompts))
        evaluation.pop("samples")
        result["quality"][role] = evaluation
        print(role, {k: evaluation[k] for k in ("val_loss", "parse_rate", "degenerate_rate", "looping_rate")}, flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "evaluation.json").write_text(json.dumps(result, indent=2) + "\n")
    q, d = result["quality"], result["decoding"]
    lines = ["# CLLM vs target: tokens per forward and quality\n",
             f"`python scripts/evaluate_cllm.py --target {args.target} --cllm {args.cllm} --count {args.count} "
             f"--block-sizes {args.block_sizes} --recycle {args.recycle} --blocks-in-flight {args.blocks_in_flight} "
             f"--threads {args.threads} --out {args.out}` ({args.prompts}, first {args.count} prompts, greedy, {args.max_new_tokens} new "
             f"tokens, {args.threads} thread(s)).\n",
             "| decoding | target TPF | CLLM TPF | CLLM output == its greedy |", "|---|---|---|---|"]
    for key in d["cllm"]:
        c = d["cllm"][key]
        lines.append(f"| {key} | {d['target'][key]['tokens_per_forward']:.3f} | {c['tokens_per_forward']:.3f} | "
                     f"{c['equal_to_greedy']}/{c['prompts']} |")
    lines += ["", "| quality (as in the target's model card) | target | CLLM |", "|---|---|---|"]
    for key, label in (("val_loss", "validation loss, whole stdlib-val split (nats/token)"),
                       ("parse_rate", "128-token completions that parse"),
                       ("degenerate_rate", "degenerate completions"), ("looping_rate", "completions ending in a loop")):
        lines.append(f"| {label} | {q['target'][key]:.3f} | {q['cllm'][key]:.3f} |")
    ratio = q["cllm"]["val_loss"] / q["target"]["val_loss"] - 1
    lines.append(f"\nValidation loss change: {100 * ratio:+.1f}%.")
    (out / "README.md").write_text("\n".join(lines) + "\n")
    print((out / "README.md").read_text())


if __name__ == "__main__":
    main()
