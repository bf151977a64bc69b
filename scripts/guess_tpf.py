"""Jacobi tokens per forward by initial guess and block size (counts only, no timing).

    python scripts/guess_tpf.py --models stdlib-coder,stdlib-coder-cllm --prompts humaneval --count 32

Every decode is also checked against the model's greedy output (it must be identical).
"""

from __future__ import annotations

import argparse

import torch

from cllm import greedy_decode, jacobi_decode
from cllm.data.prompts import load_prompts
from cllm.models import load_model, load_tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="stdlib-coder,stdlib-coder-cllm")
    ap.add_argument("--prompts", default="humaneval")
    ap.add_argument("--count", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-sizes", default="16,32")
    ap.add_argument("--guesses", default="prompt,lookup")
    ap.add_argument("--recycle", default="0", help="comma-separated recycle settings (0: plain Jacobi)")
    ap.add_argument("--blocks", default="1", help="comma-separated blocks_in_flight settings")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print("| model | n | guess | recycle | blocks in flight | tokens per forward | == greedy |\n|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        model, tok = load_model(name, dtype="float32"), load_tokenizer(name)
        prompts = [torch.tensor([tok(p.text)["input_ids"]]) for p in load_prompts(args.prompts, limit=args.count)]
        greedy = [greedy_decode(model, ids, max_new_tokens=args.max_new_tokens,
                                eos_token_id=tok.eos_token_id).new_tokens[0] for ids in prompts]
        for n in map(int, args.block_sizes.split(",")):
            for guess in args.guesses.split(","):
                for recycle, blocks in [(r, b) for r in map(int, args.recycle.split(","))
                                        for b in map(int, args.blocks.split(","))]:
                    new = forwards = same = 0
                    for ids, want in zip(prompts, greedy, strict=True):
                        out = jacobi_decode(model, ids, block_size=n, max_new_tokens=args.max_new_tokens,
                                            guess=guess, recycle=recycle, blocks_in_flight=blocks,
                                            eos_token_id=tok.eos_token_id,
                                            generator=torch.Generator().manual_seed(0))
                        new, forwards = new + len(out.new_tokens[0]), forwards + out.forward_passes
                        same += out.new_tokens[0] == want
                    print(f"| {name} | {n} | {guess} | {recycle} | {blocks} | {new / forwards:.3f} | {same}/{len(prompts)} |",
                          flush=True)


if __name__ == "__main__":
    main()
